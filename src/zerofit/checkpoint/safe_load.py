"""Never unpickle a stranger's code: check a checkpoint's pickles before anything loads them.

A pickle can name any importable callable and have the loader call it (`os.system` included), so loading a
checkpoint from someone else's run folder could run their code. zerofit's own loads use
`torch.load(weights_only=True)`, which imports only torch's safe set; but DeepSpeed's readers
(`engine.load_checkpoint`, `ds_to_universal`, `zero_to_fp32`) and `torch.distributed.checkpoint` (a
`.metadata` pickle, and `torch.load(weights_only=False)` for non-tensor entries) unpickle whatever the
file names. So before any of them reads a checkpoint, every pickle in it is checked *without unpickling
it*: a `torch.save` file by `torch.serialization.get_unsafe_globals_in_checkpoint` (a static scan of its
opcodes; one it cannot scan is refused), DCP's `.metadata` by an unpickler that resolves only an
allow-list. A file passes only if it names nothing beyond torch's weights-only set plus exactly the
globals zerofit's own checkpoints contain (listed below, found by saving ZeRO-0/1/2/3, FSDP2 and single
checkpoints of tiny-llama and listing their globals).

A file that names anything else is refused with one paragraph (the file, the globals, the risk, the
opt-in). Someone who trusts the source may opt in for the files only a pickling reader reads
(`checkpoint.trust_pickles=true` on resume, `--trust-pickles` for `zerofit export` / `generate`); zerofit's
own `weights_only=True` loads cannot read such a file at all, so no opt-in applies to them.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.serialization import get_unsafe_globals_in_checkpoint

from zerofit.core.errors import ZerofitError

__all__ = [
    "DCP_METADATA_GLOBALS",
    "DEEPSPEED_GLOBALS",
    "Finding",
    "UnsafeCheckpointError",
    "check_checkpoint",
    "refuse_unsafe",
]

# What DeepSpeed pickles into its ZeRO optimizer states besides tensors and plain containers: the ZeRO
# stage (an IntEnum), the loss scaler (static; dynamic under fp16), and each partition's fragment address
# (a dataclass of two ints). Saving ZeRO-0/1/2/3 in fp32 and bf16 (LoRA and full) produces exactly these.
DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
# What `torch.distributed.checkpoint` pickles into `dcp/.metadata`: its metadata dataclasses, shapes,
# dtypes, layouts, and the checkpoint id (a path).
DCP_METADATA_GLOBALS = frozenset(
    {
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "torch.Size",
        "torch.serialization._get_layout",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        *(
            f"torch.distributed.checkpoint.metadata.{name}"
            for name in (
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(f"torch.{dtype}" for dtype in _DTYPES),
    }
)
DCP_METADATA = ".metadata"

# Which reader loads a file, by its place in a checkpoint: only a pickling reader can be trusted into
# loading a file with foreign globals (zerofit's weights_only loads refuse it whatever the user says).
PICKLING_READERS = ("DeepSpeed", "torch.distributed.checkpoint")


class UnsafeCheckpointError(ZerofitError):
    """A checkpoint file would import code beyond the allow-list if it were unpickled."""


@dataclass(frozen=True)
class Finding:
    """One file of a checkpoint that fails the check: what it would import, or why it cannot be checked."""

    file: Path
    reader: str  # who would load it: "zerofit", "DeepSpeed" or "torch.distributed.checkpoint"
    problem: str  # "would import os.system, ..." or "cannot be checked (...)"

    @property
    def trustable(self) -> bool:
        """True when an opt-in can make the load go ahead (a pickling reader, not a weights_only load)."""
        return self.reader in PICKLING_READERS


def _torch_file_problem(source: Path | io.BytesIO, allowed: frozenset[str]) -> str | None:
    """None when the `torch.save` file names only safe globals; else what is wrong with it."""
    try:
        foreign = sorted(set(get_unsafe_globals_in_checkpoint(source)) - allowed)
    except Exception as exc:  # not a zip checkpoint, a torchscript archive, opcodes the scan does not know
        return f"cannot be checked without unpickling it ({type(exc).__name__}: {exc})"
    return f"would import {', '.join(foreign)}" if foreign else None


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves only `DCP_METADATA_GLOBALS`; anything else is refused before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in DCP_METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"would import {module}.{name}")
        return super().find_class(module, name)


def _dcp_findings(dcp_dir: Path) -> list[Finding]:
    """Check a DCP folder: its `.metadata` pickle, then every non-tensor entry (a `torch.save` blob that DCP
    reads with weights_only=False) at the place the metadata gives for it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    reader = PICKLING_READERS[1]
    metadata_file = dcp_dir / DCP_METADATA
    try:
        with metadata_file.open("rb") as f:
            metadata = _AllowListUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        return [Finding(metadata_file, reader, str(exc))]
    except Exception as exc:
        return [Finding(metadata_file, reader, f"cannot be checked ({type(exc).__name__}: {exc})")]
    findings = []
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        info = metadata.storage_data.get(MetadataIndex(key))
        if info is None or info.transform_descriptors:
            continue  # nothing DCP would read as it is stored; a transformed blob is refused by DCP itself
        file = dcp_dir / info.relative_path
        try:
            with file.open("rb") as f:
                f.seek(info.offset)
                blob = io.BytesIO(f.read(info.length))
        except OSError as exc:
            findings.append(Finding(file, reader, f"cannot be checked ({exc})"))
            continue
        problem = _torch_file_problem(blob, frozenset())
        if problem is not None:
            findings.append(Finding(file, reader, f"entry {key!r} {problem}"))
    return findings


def check_checkpoint(folder: Path, deepspeed_dir: str, dcp_dir: str) -> list[Finding]:
    """Every pickle of checkpoint `folder` that names a global beyond the allow-list (empty: safe to load).

    The two folder names are the checkpoint layout of the strategies that write them (DeepSpeed's `TAG`,
    FSDP2's `DCP_DIR`): the callers pass them, so this module restates no layout.

    `*.pt` files under `deepspeed_dir/` are DeepSpeed's (read by its unpickling loaders; DeepSpeed's
    allow-list applies); `dcp_dir/` is a DCP folder; every other `*.pt` is zerofit's own (state.pt,
    rng-rankN.pt, extra.pt: torch's weights-only set only).
    """
    folder = Path(folder)
    findings: list[Finding] = []
    for path in sorted(folder.rglob("*.pt")):
        relative = path.relative_to(folder).parts
        if relative[0] == dcp_dir:
            continue
        ours = relative[0] != deepspeed_dir
        problem = _torch_file_problem(path, frozenset() if ours else DEEPSPEED_GLOBALS)
        if problem is not None:
            findings.append(Finding(path, "zerofit" if ours else PICKLING_READERS[0], problem))
    if (folder / dcp_dir / DCP_METADATA).is_file():
        findings += _dcp_findings(folder / dcp_dir)
    return findings


def refuse_unsafe(findings: list[Finding], trusted: bool, opt_in: str, purpose: str) -> None:
    """Raise `UnsafeCheckpointError` (one paragraph) for `findings`, unless every one is in a file a pickling
    reader loads and the user opted in (`trusted`). `opt_in` names the key or flag; `purpose` the load."""
    blocking = [f for f in findings if not (trusted and f.trustable)]
    if not blocking:
        return
    files = "; ".join(f"{f.file} ({f.problem})" for f in blocking)
    if all(f.trustable for f in blocking):
        fix = (
            f"Do not load it unless you trust whoever made this checkpoint; if you do, {opt_in} lets "
            f"{' and '.join(sorted({f.reader for f in blocking}))} unpickle it"
        )
    else:
        fix = (
            "zerofit reads this file with torch.load(weights_only=True), which cannot load it whatever you "
            "trust, so no opt-in applies: restore the file from a copy you trust, or use another checkpoint"
        )
    raise UnsafeCheckpointError(
        f"{purpose}: refusing to unpickle {files}. Loading a pickle that names these globals would run code "
        "from the file (a crafted checkpoint can execute any command as you); zerofit's own checkpoints name "
        "only tensors, plain containers and the DeepSpeed / DCP classes zerofit allow-lists, so this file "
        f"was altered or made elsewhere. {fix}."
    )


def allowed_classes() -> list[Any]:
    """The allow-listed DeepSpeed classes, for `torch.serialization.safe_globals` when zerofit itself loads a
    DeepSpeed file with weights_only=True (imports DeepSpeed: call it only where DeepSpeed is used)."""
    import importlib

    classes = []
    for name in sorted(DEEPSPEED_GLOBALS):
        module, _, attr = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attr))
    return classes


def load_deepspeed_file(path: Path) -> Any:
    """A DeepSpeed `.pt` file, loaded with weights_only=True and only DeepSpeed's allow-listed classes."""
    with torch.serialization.safe_globals(allowed_classes()):
        return torch.load(path, map_location="cpu", weights_only=True)
