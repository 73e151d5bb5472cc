"""Where a run's trained weights are, and how to read them back whichever engine wrote them.

A run leaves its weights in two kinds of places (docs/contracts.md, "Run directory"):

- the final export, `adapter/` (LoRA: a peft folder) or `model/` (full fine-tuning: a Hugging Face folder),
  written at the end unless `checkpoint.save_final=false`;
- complete checkpoints, `checkpoints/step-N/` with a `manifest.json` (written last), in their engine's own
  layout:

      engine/            DeepSpeed ZeRO 0-3 (tag `engine`): model states + each rank's fp32 partitions
      dcp/ (+ extra.pt)  FSDP2: a torch.distributed.checkpoint folder holding {"model": ..., "optim": ...}
      state.pt           single / DDP: {"model": the trainable tensors, ...}

This module is the one reader of those layouts; their names belong to their writers (the run directory's
to `zerofit.core.run_layout`, each engine's to the strategy module that saves it: `TAG`, `STATE_FILE`; FSDP2's
`DCP_DIR` to `zerofit.strategies.fsdp_layout`, which imports no torch.distributed)
and are imported from there. Checkpoints hold only what trains (frozen LoRA base weights are left out), so
`read_checkpoint` returns the trainable tensors, named as the unwrapped peft or Hugging Face model names
them, in fp32 wherever the engine kept fp32 master weights. Reading needs no process group and no
GPU: DeepSpeed's own `zero_to_fp32` merges ZeRO partitions, `torch.distributed.checkpoint` loads DCP shards
in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from zerofit.checkpoint import MANIFEST, complete_checkpoints
from zerofit.checkpoint.final_export import final_export_step
from zerofit.checkpoint.safe_load import check_checkpoint, load_deepspeed_file, refuse_unsafe
from zerofit.core.errors import ConfigError, ZerofitError
from zerofit.core.run_layout import ADAPTER_DIR, MODEL_DIR, step_dir_name
from zerofit.models.safe_weights import check_zerofit_folder
from zerofit.strategies.deepspeed import TAG as DEEPSPEED_TAG
from zerofit.strategies.fsdp_layout import DCP_DIR, DCP_MODEL_KEY
from zerofit.strategies.single import STATE_FILE, STATE_MODEL_KEY

__all__ = ["CheckpointVanishedError", "WeightsSource", "find_weights", "read_checkpoint", "snapshot"]

TRUST_FLAG = "--trust-pickles"  # `zerofit export` / `zerofit generate`: let DeepSpeed / DCP unpickle


class CheckpointVanishedError(ZerofitError):
    """The checkpoint was deleted (pruned by a running training) before it could be read."""


@dataclass(frozen=True)
class WeightsSource:
    """Where a run's trained weights are read from: its final export folder, or one complete checkpoint."""

    kind: Literal["adapter", "model", "checkpoint"]
    path: Path
    step: int | None  # optimizer steps the weights have seen (None: a final export of a run without summary)
    trust_pickles: bool = False  # the user trusts this run's checkpoint pickles (`--trust-pickles`)

    def describe(self) -> str:
        """One phrase for messages and the model card."""
        if self.kind == "checkpoint":
            return f"checkpoint {self.path.name} ({self.engine_layout()} layout)"
        where = f"final export {self.path.name}/"
        return where + (f" (step {self.step})" if self.step is not None else "")

    def engine_layout(self) -> str:
        """`deepspeed`, `fsdp` or `single` for a checkpoint (by the files in it); the kind otherwise."""
        if self.kind != "checkpoint":
            return self.kind
        if (self.path / DCP_DIR).is_dir():
            return "fsdp"
        if (self.path / STATE_FILE).is_file():
            return "single"
        if (self.path / DEEPSPEED_TAG).is_dir():
            return "deepspeed"
        return "unknown"


def find_weights(run_dir: Path, step: int | None = None, trust_pickles: bool = False) -> WeightsSource:
    """The weights to export from `run_dir`: checkpoint `step` if given, else the newest of the final export
    and the complete checkpoints (the final export on a tie: it is what the run itself wrote at its end).
    `trust_pickles` travels with the source to `read_checkpoint`.

    Raises `ConfigError` naming what the folder holds when there is nothing (or not that step) to read.
    """
    source = _find_weights(Path(run_dir), step)
    return dataclasses.replace(source, trust_pickles=trust_pickles)


def _find_weights(run_dir: Path, step: int | None) -> WeightsSource:
    checkpoints = complete_checkpoints(run_dir)
    if step is not None:
        for found_step, folder in checkpoints:
            if found_step == step:
                return WeightsSource("checkpoint", folder, step)
        have = ", ".join(str(s) for s, _ in checkpoints) or "none"
        raise ConfigError(
            [
                f"--step {step}: {run_dir} has no complete checkpoint {step_dir_name(step)} (complete "
                f"checkpoints: {have}); "
                "pick one of those steps, or leave --step out to use the newest weights"
            ]
        )
    final: WeightsSource | None = None
    for kind in (ADAPTER_DIR, MODEL_DIR):
        folder = run_dir / kind
        if folder.is_dir() and any(folder.glob("*.safetensors")):
            final = WeightsSource(kind, folder, final_export_step(run_dir))  # type: ignore[arg-type]
            break
    newest = WeightsSource("checkpoint", checkpoints[-1][1], checkpoints[-1][0]) if checkpoints else None
    if final is not None and (newest is None or final.step is None or final.step >= (newest.step or 0)):
        check_zerofit_folder(final.path, f"the final export {final.path.name}/ of run {run_dir}")
        return final
    if newest is not None:
        return newest
    raise ConfigError(
        [
            f"{run_dir} holds no trained weights: no final export ({ADAPTER_DIR}/ or {MODEL_DIR}/) and no complete "
            "checkpoint (checkpoints/step-N/ with a manifest.json); pass the directory of a run that finished "
            "a checkpoint (checkpoint.every_steps saves during training; every run saves one at its end)"
        ]
    )


def read_checkpoint(folder: Path, trust_pickles: bool = False) -> dict[str, torch.Tensor]:
    """The trainable tensors saved in checkpoint `folder` (any engine's layout), on the CPU, detached.

    The folder is read through a snapshot (`snapshot`), so a running training that prunes it meanwhile
    cannot delete it under the reader; every pickle in the snapshot is checked first (`zerofit.checkpoint.safe_load`),
    and one naming code beyond the allow-list is refused unless `trust_pickles`.
    """
    with snapshot(Path(folder)) as copy:
        findings = [  # named by the folder the user gave, not the snapshot
            dataclasses.replace(f, file=Path(folder) / f.file.relative_to(copy))
            for f in check_checkpoint(copy, DEEPSPEED_TAG, DCP_DIR)
        ]
        refuse_unsafe(
            findings,
            trust_pickles,
            TRUST_FLAG,
            f"reading checkpoint {folder}",
        )
        state = _read_layout(copy, Path(folder))
    return {name: tensor.detach().cpu() for name, tensor in state.items()}


def _vanished(folder: Path) -> CheckpointVanishedError:
    newest = complete_checkpoints(folder.parent.parent)
    now = f"; its newest checkpoint is now {newest[-1][1].name}" if newest else ""
    return CheckpointVanishedError(
        f"checkpoint {folder} was deleted before it could be read: a training still running in "
        f"{folder.parent.parent} pruned it (checkpoint.keep_last keeps only the newest ones){now}. The checkpoint "
        "itself was fine; retry (without --step zerofit picks the newest weights), or raise checkpoint.keep_last "
        "in the running training's config to keep more checkpoints around"
    )


@contextlib.contextmanager
def snapshot(folder: Path) -> Iterator[Path]:
    """A private copy of checkpoint `folder` for as long as the block runs: every file its manifest lists,
    hard-linked (no data copied) into a hidden temporary folder beside it, so that pruning (which deletes
    the folder) cannot take the files away mid-read. Where hard links are impossible the files are copied;
    where the folder cannot be written beside, it is read in place. Raises `CheckpointVanishedError` if
    the folder or one of its files is gone before the snapshot holds it."""
    try:
        names = [MANIFEST, *json.loads((folder / MANIFEST).read_text()).get("files", {})]
    except FileNotFoundError:
        if not folder.exists():
            raise _vanished(folder) from None
        names = None
    except (OSError, ValueError, AttributeError):
        names = None  # not a zerofit manifest: read the folder as it is (the layout check reports it)
    if names is None:
        yield folder
        return
    try:
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.read-", dir=folder.parent))
    except OSError:  # a read-only run folder: nothing can prune it from this process's side
        yield folder
        return
    try:
        for name in names:
            _link(folder, scratch, name)
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _link(folder: Path, scratch: Path, name: str) -> None:
    """Hard-link (else copy) `folder/name` to `scratch/name`; a name leaving the folder is refused."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConfigError(
            [
                f"{folder / MANIFEST} lists {name!r}, a file outside the checkpoint folder: it is not a checkpoint "
                "zerofit wrote; use another checkpoint"
            ]
        )
    target = scratch / name
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        try:
            os.link(folder / name, target)
        except FileNotFoundError:
            raise  # gone: not a filesystem without hard links (handled below)
        except OSError:  # no hard links on this filesystem
            shutil.copy2(folder / name, target)
    except FileNotFoundError:
        raise _missing(folder, name) from None


def _missing(folder: Path, name: str) -> ZerofitError:
    """A listed file is gone: pruning in progress (the folder disappears within moments) or damage."""
    for _ in range(20):  # a prune is one rmtree: the folder is gone a moment after its first file
        if not folder.exists():
            return _vanished(folder)
        time.sleep(0.1)
    return ConfigError(
        [
            f"checkpoint {folder} lacks {name}, which its {MANIFEST} lists: the checkpoint is damaged; pick "
            "another one with --step"
        ]
    )


def _read_layout(folder: Path, named: Path) -> dict[str, torch.Tensor]:
    """The trainable tensors of checkpoint `folder` (a snapshot of `named`, which messages name)."""
    if (folder / STATE_FILE).is_file():
        return _read_state_file(folder / STATE_FILE)
    if (folder / DCP_DIR).is_dir():
        return _read_dcp(folder / DCP_DIR)
    if (folder / DEEPSPEED_TAG).is_dir():
        return _read_deepspeed(folder)
    raise ConfigError(
        [
            f"{named} is not a checkpoint zerofit can read: it has none of {STATE_FILE} (single / DDP), "
            f"{DCP_DIR}/ (FSDP2) or {DEEPSPEED_TAG}/ (DeepSpeed)"
        ]
    )


def _read_state_file(path: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, map_location="cpu", weights_only=True)[STATE_MODEL_KEY])


def _read_dcp(path: Path) -> dict[str, torch.Tensor]:
    """The model part of an FSDP2 DCP checkpoint, resharded into whole tensors in this one process."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = DCP_MODEL_KEY + "."
    model: dict[str, torch.Tensor] = {}
    for key, meta in metadata.items():
        if key.startswith(prefix) and isinstance(meta, dcp.metadata.TensorStorageMetadata):
            model[key.removeprefix(prefix)] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming the intent is to load in a single process": it is.
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        dcp.load({DCP_MODEL_KEY: model}, checkpoint_id=str(path), no_dist=True)
    return model


def _read_deepspeed(folder: Path) -> dict[str, torch.Tensor]:
    """ZeRO 1-3: DeepSpeed's zero_to_fp32 merges every rank's fp32 partitions; ZeRO-0 keeps whole weights in
    the model-states file (there are no partitions to merge)."""
    engine_dir = folder / DEEPSPEED_TAG
    if not any(engine_dir.glob("*_optim_states.pt")):
        # DeepSpeed's own file: weights only, its allow-listed classes included (zerofit.checkpoint.safe_load).
        states = load_deepspeed_file(engine_dir / "mp_rank_00_model_states.pt")
        return dict(states["module"])
    # DeepSpeed announces its accelerator on import, zero_to_fp32 narrates every tensor on stdout and draws
    # a progress bar on stderr: none of it is for the user of `zerofit export`.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(
            get_fp32_state_dict_from_zero_checkpoint(
                str(folder), tag=DEEPSPEED_TAG, exclude_frozen_parameters=True
            )
        )
