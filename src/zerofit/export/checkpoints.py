"""Where a run's trained weights are, and how to read them back whichever engine wrote them.

A run leaves its weights in two kinds of places (docs/contracts.md, "Run directory"):

- the final export, `adapter/` (LoRA: a peft folder) or `model/` (full fine-tuning: a Hugging Face folder),
  written at the end unless `checkpoint.save_final=false`;
- complete checkpoints, `checkpoints/step-N/` with a `manifest.json` (written last), in their engine's own
  layout:

      engine/            DeepSpeed ZeRO 0-3 (tag `engine`): model states + each rank's fp32 partitions
      dcp/ (+ extra.pt)  FSDP2: a torch.distributed.checkpoint folder holding {"model": ..., "optim": ...}
      state.pt           single / DDP: {"model": the trainable tensors, ...}

This module is the one place outside the writers (the strategies and `zerofit.checkpoint`) that knows those
layouts; a change to them is a change here. Checkpoints hold only what trains (frozen LoRA base weights are
left out), so `read_checkpoint` returns the trainable tensors, named as the unwrapped peft or Hugging Face
model names them, in fp32 wherever the engine kept fp32 master weights. Reading needs no process group and no
GPU: DeepSpeed's own `zero_to_fp32` merges ZeRO partitions, `torch.distributed.checkpoint` loads DCP shards
in one process.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from zerofit.checkpoint import complete_checkpoints
from zerofit.errors import ConfigError

__all__ = ["WeightsSource", "find_weights", "read_checkpoint"]

ADAPTER_DIR, MODEL_DIR = "adapter", "model"  # the final export (zerofit.checkpoint.export_final)
DEEPSPEED_TAG = "engine"  # deepspeed: engine.save_checkpoint(step_dir, tag="engine")
DCP_DIR, DCP_MODEL_KEY = "dcp", "model"  # fsdp: dcp.save({"model": ..., "optim": ...}, step_dir / "dcp")
STATE_FILE, STATE_MODEL_KEY = (
    "state.pt",
    "model",
)  # single / ddp: torch.save({"model": ...}, step_dir / "state.pt")


@dataclass(frozen=True)
class WeightsSource:
    """Where a run's trained weights are read from: its final export folder, or one complete checkpoint."""

    kind: Literal["adapter", "model", "checkpoint"]
    path: Path
    step: int | None  # optimizer steps the weights have seen (None: a final export of a run without summary)

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


def _final_export_step(run_dir: Path) -> int | None:
    """The step the final export was written at: the last logged step of the run's summary, if any."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    step = summary.get("last_step") if isinstance(summary, dict) else None
    return step if isinstance(step, int) else None


def find_weights(run_dir: Path, step: int | None = None) -> WeightsSource:
    """The weights to export from `run_dir`: checkpoint `step` if given, else the newest of the final export
    and the complete checkpoints (the final export on a tie: it is what the run itself wrote at its end).

    Raises `ConfigError` naming what the folder holds when there is nothing (or not that step) to read.
    """
    run_dir = Path(run_dir)
    checkpoints = complete_checkpoints(run_dir)
    if step is not None:
        for found_step, folder in checkpoints:
            if found_step == step:
                return WeightsSource("checkpoint", folder, step)
        have = ", ".join(str(s) for s, _ in checkpoints) or "none"
        raise ConfigError(
            [
                f"--step {step}: {run_dir} has no complete checkpoint step-{step} (complete checkpoints: {have}); "
                "pick one of those steps, or leave --step out to use the newest weights"
            ]
        )
    final: WeightsSource | None = None
    for kind in (ADAPTER_DIR, MODEL_DIR):
        folder = run_dir / kind
        if folder.is_dir() and any(folder.glob("*.safetensors")):
            final = WeightsSource(kind, folder, _final_export_step(run_dir))  # type: ignore[arg-type]
            break
    newest = WeightsSource("checkpoint", checkpoints[-1][1], checkpoints[-1][0]) if checkpoints else None
    if final is not None and (newest is None or final.step is None or final.step >= (newest.step or 0)):
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


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """The trainable tensors saved in checkpoint `folder` (any engine's layout), on the CPU, detached."""
    folder = Path(folder)
    if (folder / STATE_FILE).is_file():
        state = _read_state_file(folder / STATE_FILE)
    elif (folder / DCP_DIR).is_dir():
        state = _read_dcp(folder / DCP_DIR)
    elif (folder / DEEPSPEED_TAG).is_dir():
        state = _read_deepspeed(folder)
    else:
        raise ConfigError(
            [
                f"{folder} is not a checkpoint zerofit can read: it has none of {STATE_FILE} (single / DDP), "
                f"{DCP_DIR}/ (FSDP2) or {DEEPSPEED_TAG}/ (DeepSpeed)"
            ]
        )
    return {name: tensor.detach().cpu() for name, tensor in state.items()}


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
        # DeepSpeed's own file (it pickles its config objects too), read as DeepSpeed itself reads it.
        states = torch.load(engine_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
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
