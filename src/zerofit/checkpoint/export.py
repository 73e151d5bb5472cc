"""The final export: the full weights gathered through the strategy (ZeRO-3 partitions, FSDP shards), written
by rank 0 as a normal Hugging Face folder: the peft adapter (`adapter/`) or the whole model (`model/`), plus
the tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from zerofit.strategies.base import Strategy


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a peft-wrapped model (its export is the adapter only)."""
    return hasattr(model, "peft_config")


def export_final(strategy: Strategy, tokenizer: Any, run_dir: Path) -> Path:
    """Write `adapter/` (LoRA) or `model/` (full) + tokenizer into `run_dir`; collective, rank 0 writes."""
    state = strategy.full_state_dict()  # every rank takes part in the gather
    model = strategy.unwrap()
    out = Path(run_dir) / ("adapter" if is_peft_model(model) else "model")
    if strategy.rank == 0:
        assert state is not None
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        kwargs = {"save_embedding_layers": False} if is_peft_model(model) else {}
        # (LoRA on lm_head would make peft also save the frozen base head: it never changes, so it is left out.)
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True, **kwargs)
        _fix_architectures(model, tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    strategy.wait_for_rank0("rank 0 to write the final export")  # a 7B write may outlast the pg timeout
    strategy.barrier()
    return out


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
