"""The final export: the full weights gathered through the strategy (ZeRO-3 partitions, FSDP shards), written
by rank 0 as a normal Hugging Face folder: the peft adapter (`adapter/`) or the whole model (`model/`), plus
the tokenizer.

`save_pretrained_here` is the one way zerofit writes a model folder (here and in `zerofit export`): zerofit
decides which process writes, so the write must not also depend on the distributed state the libraries
see, and a folder without weights is never renamed into place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from zerofit.catalogue.models import is_tiny_model
from zerofit.checkpoint.failed_save import attempt, export_failed
from zerofit.config.schema import ZerofitConfig
from zerofit.core.file_modes import follow_umask
from zerofit.core.lazy import hidden_unless_loaded
from zerofit.core.run_layout import BASE_MODEL_FILE, RunLayout
from zerofit.strategies.base import Strategy

# What a saved folder holds its weights in: one safetensors file, a sharded one's index, or peft's adapter.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a peft-wrapped model (its export is the adapter only)."""
    return hasattr(model, "peft_config")


def export_final(
    strategy: Strategy, tokenizer: Any, run_dir: Path, config: ZerofitConfig | None = None
) -> Path:
    """Write `adapter/` (LoRA) or `model/` (full) + tokenizer into `run_dir`; collective, rank 0 writes.
    `config` (the run's): an adapter also records its base model as named there (`record_base_model`).

    A write that fails (a full disk) leaves no partial folder and ends on every rank with the same
    `ExportWriteError` paragraph: the final checkpoint, saved just before, holds the trained weights.
    """
    state = strategy.full_state_dict()  # every rank takes part in the gather
    model = strategy.unwrap()
    out = RunLayout(Path(run_dir)).export(adapter=is_peft_model(model))
    tmp = out.with_name(out.name + ".tmp")
    failure = None
    if strategy.rank == 0:
        assert state is not None
        failure = attempt(lambda: _write_export(model, tokenizer, state, tmp, out, config))
        if failure is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    strategy.wait_for_rank0("rank 0 to write the final export")  # a 7B write may outlast the pg timeout
    failure = strategy.broadcast_object(failure)
    if failure is not None:
        raise export_failed(out, failure)
    return out


def _write_export(
    model: torch.nn.Module,
    tokenizer: Any,
    state: dict[str, torch.Tensor],
    tmp: Path,
    out: Path,
    config: ZerofitConfig | None = None,
) -> None:
    """Rank 0: the model folder under a temporary name, then renamed into place."""
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"save_embedding_layers": False} if is_peft_model(model) else {}
    # (LoRA on lm_head would make peft also save the frozen base head: it never changes, so it is left out.)
    save_pretrained_here(model, tmp, state_dict=state, safe_serialization=True, **kwargs)
    _fix_architectures(model, tmp)
    tokenizer.save_pretrained(tmp)
    if config is not None and is_peft_model(model):
        record_base_model(tmp, config)
    follow_umask(tmp)  # safetensors writes its files 0600; the folder's other files follow the umask
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def save_pretrained_here(model: Any, folder: Path, **kwargs: Any) -> None:
    """`model.save_pretrained(folder, **kwargs)`, written by this process whatever the distributed state.

    transformers 5 writes nothing (no config, no weights) from a process that is not rank 0 of an
    initialized process group (`PreTrainedModel.should_save_on_this_rank`), silently. The caller has
    already chosen the writer (rank 0 of the final export, the one process of `zerofit export`), so the
    model is told to write here; a folder that still ends up without weights raises instead of being
    renamed into place as an export.
    """
    # (A peft model forwards the attribute to its base; its own save_pretrained has no rank rule.)
    overridable = hasattr(model, "should_save_on_this_rank")
    if overridable:
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        # (transformers unwraps the model through accelerate, which imports DeepSpeed for its engine type:
        # a process without DeepSpeed loaded has no engine to unwrap, `zerofit.core.lazy`.)
        with hidden_unless_loaded("deepspeed"):
            model.save_pretrained(folder, **kwargs)
    finally:
        if overridable:
            del model.should_save_on_this_rank
    if not any((Path(folder) / name).is_file() for name in WEIGHT_FILES):
        raise RuntimeError(
            f"save_pretrained wrote no weights into {folder} (none of {', '.join(WEIGHT_FILES)})"
        )


def record_base_model(folder: Path, config: ZerofitConfig) -> None:
    """`zerofit_base_model.json` beside the adapter in `folder`: the base model as the config names it (a
    hub id, a built-in name with the seed it is built from, or the user's folder), which resolves on another
    machine, and the path adapter_config.json names, which is where this machine loaded it from (a built-in
    model's cache folder). adapter_config.json itself keeps peft's fields only: peft warns on any other key."""
    saved = json.loads((folder / "adapter_config.json").read_text())
    name = config.model.name_or_path
    record: dict[str, Any] = {
        "base_model": name,
        "local_path": saved.get("base_model_name_or_path"),
    }
    if is_tiny_model(name):
        record["seed"] = config.seed
        record["note"] = (
            f"{name} is a zerofit built-in model, built from its name and seed: model.name_or_path={name} "
            f"seed={config.seed} gives the same weights on any machine (zerofit export / generate do this)"
        )
    (folder / BASE_MODEL_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _fix_architectures(model: torch.nn.Module, folder: Path) -> None:
    # FSDP2 swaps the model's class for a generated `FSDP<Name>` subclass, which save_pretrained would
    # record as the architecture; write the real class name so the folder loads like any HF model.
    config_file = folder / "config.json"
    name = type(model).__name__
    if not config_file.is_file() or not name.startswith("FSDP"):
        return
    config = json.loads(config_file.read_text())
    config["architectures"] = [name.removeprefix("FSDP")]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def final_export_step(run_dir: Path) -> int | None:
    """The step the final export (`adapter/` or `model/`) was written at: the last logged step of the run's
    summary.json, written after it; None without one (a run stopped before its export, or an older run)."""
    try:
        summary = json.loads(RunLayout(run_dir).summary.read_text())
    except (OSError, ValueError):
        return None
    step = summary.get("last_step") if isinstance(summary, dict) else None
    return step if isinstance(step, int) else None
