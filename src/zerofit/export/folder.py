"""`export_run`: a run's trained weights as a folder other tools load, written atomically.

    LoRA, default    the adapter as a peft folder (`PeftModel` / `AutoPeftModelForCausalLM` load it)
    LoRA, merge      the adapters merged into the base (peft's `merge_and_unload`, in fp32, QLoRA
                     dequantized first), saved as Hugging Face safetensors in `--dtype`, which
                     `AutoModelForCausalLM.from_pretrained` loads with no peft and no zerofit
    full fine-tune   the whole model, as Hugging Face safetensors in `--dtype`

Every export also holds the tokenizer, a model card (`README.md`) and `zerofit_export.json` (the source run,
step, kind and the run's config, which `zerofit generate` reads). The folder is written under a temporary
name next to `--out` and renamed into place only when complete, so an interrupted export never replaces a
good one; `--out` must be new, empty, or an earlier zerofit export.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.checkpoint.final_export import record_base_model, save_pretrained_here
from zerofit.core.errors import ConfigError
from zerofit.core.file_modes import follow_umask
from zerofit.core.precision import DTYPES, torch_dtype
from zerofit.core.progress import progress
from zerofit.export.card import model_card
from zerofit.export.checkpoints import WeightsSource, find_weights, read_checkpoint
from zerofit.export.trained import RunConfig, build_trained, read_run_config, tokenizer_for, with_run_adapters
from zerofit.models.build import resolve_model_path
from zerofit.models.vision import save_image_processor

__all__ = [
    "EXPORT_INFO",
    "ExportResult",
    "check_out",
    "export_run",
    "merged_model",
    "output_dtype",
    "unwritable_out",
]

EXPORT_INFO = "zerofit_export.json"
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class ExportResult:
    """What `export_run` wrote: the folder, its kind (`adapter`, `merged`, `model`), source and dtype."""

    out: Path
    kind: str
    source: WeightsSource
    dtype: str | None  # torch name of the weights' dtype (None: the adapter as trained)
    # A reward model's (train.objective: reward): a sequence classifier with a score head.
    reward: bool = False

    @property
    def size_bytes(self) -> int:
        """Bytes of the weight files."""
        return sum(p.stat().st_size for p in self.out.glob("*.safetensors"))


def output_dtype(run: RunConfig, requested: str) -> str:
    """The dtype merged / full weights are saved in: `auto` = the run's `train.precision` (bf16 runs, QLoRA
    included, give bf16), else the requested `bf16`, `fp16` or `fp32`."""
    name = run.config.train.precision if requested == "auto" else requested
    if name not in DTYPES:
        raise ConfigError([f"--dtype {requested!r}: expected auto, {', '.join(DTYPES)}"])
    return DTYPES[name].torch_name


def check_out(out: Path, run_dir: Path) -> None:
    """`--out` must not be the run itself or a folder of something else (never delete what zerofit did not write)."""
    if out.resolve() == run_dir.resolve() or run_dir.resolve().is_relative_to(out.resolve()):
        raise ConfigError([f"--out {out} would replace the run directory {run_dir}; choose a new folder"])
    if out.exists() and not out.is_dir():
        raise ConfigError([f"--out {out} is a file; choose a new folder"])
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_INFO).is_file():
        raise ConfigError(
            [
                f"--out {out} already holds files that are not a zerofit export (no {EXPORT_INFO}); choose a new "
                "or empty folder (an earlier zerofit export there is replaced, atomically)"
            ]
        )
    for target in (out, out.parent):  # files go into `out` (GGUF) or beside it, renamed into place (hf)
        _check_writable(out, target)


def _check_writable(out: Path, target: Path) -> None:
    """Refuse an `--out` whose folder `target` (or the folder it would be made in) this user cannot write,
    or that has a file in the way, before anything is loaded."""
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    code = errno.ENOTDIR if not existing.is_dir() else None
    if code is None and not os.access(existing, os.W_OK | os.X_OK):
        code = errno.EACCES
    if code is not None:
        raise unwritable_out(out, OSError(code, os.strerror(code), str(existing)))


def unwritable_out(out: Path, exc: OSError) -> ConfigError:
    """`--out` cannot be made or written into (no permission, a file in the way, a read-only filesystem),
    as one paragraph: the folder, the errno and the fix."""
    folder = exc.filename or out.parent
    return ConfigError(
        [
            f"--out {out}: {folder} cannot be written ([Errno {exc.errno}] {exc.strerror}); nothing was "
            "exported; choose an --out under a folder you can write (e.g. in your home folder), or fix that "
            "folder's permissions"
        ]
    )


def _replace(tmp: Path, out: Path) -> None:
    """`tmp` takes the name `out`; an existing `out` is moved aside first and deleted only afterwards."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _adapter_from_checkpoint(run: RunConfig, source: WeightsSource, folder: Path) -> None:
    """Write a checkpoint's LoRA tensors as a peft folder, through peft, with no base weights loaded: the
    wrapper is built on the meta device and the checkpoint's tensors are assigned into it."""
    from zerofit.models.heads import meta_head_model

    # A reward model's meta model has its score head too; a vision-language model's adapters go where its
    # training put them.
    model: Any = with_run_adapters(meta_head_model(run.config, resolve_model_path(run.config)), run.config)
    state = read_checkpoint(source.path, source.trust_pickles)
    result = model.load_state_dict(state, strict=False, assign=True)
    meta = [n for n, p in model.named_parameters() if p.requires_grad and p.is_meta]
    if result.unexpected_keys or meta:
        problem = result.unexpected_keys[:3] or meta[:3]
        raise ConfigError(
            [
                f"{source.describe()} of {run.run_dir} does not fit the LoRA config in its config.yaml ({problem}); "
                "was config.yaml edited after the run?"
            ]
        )
    # The folder names the base it adapts, as a run's own export does.
    model.peft_config["default"].base_model_name_or_path = resolve_model_path(run.config)
    save_pretrained_here(model, folder, safe_serialization=True, save_embedding_layers=False)
    record_base_model(folder, run.config)


def merged_model(run: RunConfig, source: WeightsSource) -> Any:
    """The trained model as one Hugging Face model in fp32: a LoRA run's adapters merged into its base (peft's
    `merge_and_unload`; QLoRA dequantized first), a full fine-tune as it is. Merging happens in fp32 (bf16
    base weights upcast exactly; adapters are fp32), so a caller casts once, to what it writes."""
    trained = build_trained(run, source)
    model: Any = trained.model.merge_and_unload() if trained.is_lora else trained.model
    model.config.use_cache = True  # training switched the KV cache off; generation wants it
    return model


def _write_weights(run: RunConfig, source: WeightsSource, folder: Path, merge: bool, dtype: str) -> str:
    """The weights into `folder`; returns the export's kind."""
    if run.config.lora.enabled and not merge:
        if source.kind == "adapter":
            for name in _ADAPTER_FILES:
                shutil.copy2(source.path / name, folder / name)
            record_base_model(folder, run.config)  # also for a run's adapter/ from before the record
        else:
            _adapter_from_checkpoint(run, source, folder)
        return "adapter"
    model = merged_model(run, source).to(torch_dtype(dtype))
    save_pretrained_here(model, folder, safe_serialization=True)
    return "merged" if run.config.lora.enabled else "model"


def export_run(
    run_dir: Path,
    out: Path,
    *,
    merge: bool = False,
    step: int | None = None,
    dtype: str = "auto",
    trust_pickles: bool = False,
    trust_remote_code: bool = False,
) -> ExportResult:
    """Export the trained weights of `run_dir` into `out` (see the module docstring); returns what was written.
    `trust_pickles`: let DeepSpeed / DCP unpickle a checkpoint naming globals beyond zerofit's allow-list;
    `trust_remote_code`: honour the run's `model.trust_remote_code`, which a saved config alone never turns
    on (`trained.settle_remote_code`): only then does a merged export carry the base model's own code."""
    run = read_run_config(Path(run_dir), trust_remote_code)
    out = Path(out)
    check_out(out, run.run_dir)
    source = find_weights(run.run_dir, step, trust_pickles)
    out_dtype = output_dtype(run, dtype)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:  # what `check_out` cannot see from here (a read-only filesystem as root)
        raise unwritable_out(out, exc) from None
    try:
        with progress(f"exporting {run.run_dir} to {out}"):  # loading, merging, writing: minutes on a 7B
            kind = _write_weights(run, source, tmp, merge, out_dtype)
        tokenizer_for(run, source).save_pretrained(tmp)
        save_image_processor(resolve_model_path(run.config), tmp)  # a vision-language model's processor
        weights_dtype = None if kind == "adapter" else out_dtype
        (tmp / "README.md").write_text(model_card(run, source, kind, weights_dtype))
        info = {
            "source_run": str(run.run_dir.resolve()),
            "source": source.describe(),
            "step": source.step,
            "kind": kind,
            "dtype": weights_dtype,
            "config": run.raw,
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        follow_umask(tmp)  # safetensors writes its files 0600 (and copy2 keeps an older export's mode)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    reward = run.config.train.objective == "reward"
    return ExportResult(out=out, kind=kind, source=source, dtype=weights_dtype, reward=reward)
