"""Weights load from safetensors only: a pickled weights file in a folder zerofit loads a model from is refused
before transformers or peft could read it.

transformers reads `pytorch_model.bin` and peft `adapter_model.bin` with `torch.load` when the folder has no
safetensors weights of the name they look for. Unpickling a file from elsewhere can run its code (torch's
weights-only load stops that, but then fails with its own traceback), so zerofit never lets them get there:

- a folder zerofit wrote (a `zerofit export` folder, a run's final `adapter/` or `model/`,
  `check_zerofit_folder`): zerofit writes every weight as safetensors, so any pickle there (`*.bin`, `*.pt`,
  `*.pth`, `*.ckpt`, `*.pkl`) was put there since, and is refused whatever sits beside it;
- a model folder from elsewhere (`model.name_or_path`, a reward model, a peft folder, `safetensors_only`):
  refused when it holds pickles and none of the safetensors files its loader reads, the case where the
  library would fall back to the pickle; with them, the load passes `use_safetensors=True` (a downloaded hub
  repository often holds both formats, and its pickle is then never read).

Either refusal is one paragraph naming the folder, the files and the fix (convert to safetensors). A hub id
(no local folder) is left to transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError

__all__ = [
    "ADAPTER_WEIGHTS",
    "MODEL_WEIGHTS",
    "PICKLE_SUFFIXES",
    "check_zerofit_folder",
    "pickled_files",
    "safetensors_only",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # what torch.save / pickle write weights as
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # what transformers reads first
ADAPTER_WEIGHTS = ("adapter_model.safetensors",)  # what peft reads first
_CONVERT = (
    "convert them to safetensors where you trust their source (load the folder there with transformers or "
    "peft and save_pretrained(..., safe_serialization=True)), or use a folder with safetensors weights"
)


def pickled_files(folder: Path) -> list[Path]:
    """The files of `folder` (not its subfolders: no loader reads those) that hold pickled weights."""
    try:
        return sorted(
            p for p in Path(folder).iterdir() if p.suffix.lower() in PICKLE_SUFFIXES and p.is_file()
        )
    except OSError:
        return []  # not a folder that can be listed: the load that follows reports it


def _names(files: list[Path]) -> str:
    shown = ", ".join(p.name for p in files[:3])
    return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def check_zerofit_folder(folder: Path, what: str) -> None:
    """Refuse any pickle in `folder`, a folder zerofit wrote (`what`: e.g. "the export", "the run's final
    adapter/"), before anything loads from it."""
    pickles = pickled_files(folder)
    if pickles:
        raise ConfigError(
            [
                f"{folder} is {what}, whose weights zerofit wrote as safetensors only, yet it holds pickled "
                f"weights ({_names(pickles)}): put there since, and unpickling a file can run code, so nothing "
                f"was loaded; delete or move {'it' if len(pickles) == 1 else 'them'} (the folder's own weights "
                "are its .safetensors files)"
            ]
        )


def safetensors_only(
    path: str | Path, where: str, weights: tuple[str, ...] = MODEL_WEIGHTS
) -> dict[str, Any]:
    """`from_pretrained`'s keywords that keep a load of model folder `path` (from elsewhere) to safetensors:
    `use_safetensors=True` when it holds one of `weights` (the files its loader reads first); a ConfigError
    naming `where` and the files when it holds pickles and none of them (the loader would read the pickle);
    none for a hub id or a folder with neither (the loader reports that)."""
    folder = Path(path)
    if not folder.is_dir():
        return {}
    if any((folder / name).is_file() for name in weights):
        return {"use_safetensors": True}
    pickles = pickled_files(folder)
    if pickles:
        raise ConfigError(
            [
                f"{where}: it holds only pickled weights ({_names(pickles)}) and no safetensors "
                f"({' or '.join(weights)}); reading them would unpickle a file from elsewhere, which can run "
                f"code, so zerofit loads weights from safetensors only and nothing was loaded: {_CONVERT}"
            ]
        )
    return {}
