"""Checkpoints through the strategy (atomic, resumable) and the final export (`adapter/` or `model/`).

A checkpoint is written into `checkpoints/step-N.tmp/`, marked complete only after every rank finished,
then renamed to `checkpoints/step-N/`: a crash mid-save leaves a `.tmp` folder that resume ignores, never
a half-written `step-N` in place of a good one. Resume restores model, optimizer, scheduler, RNG and the
step; the data order needs no state because the sampler is a pure function of the step.

The export gathers the full weights through the strategy (ZeRO-3 partitions, FSDP shards) and rank 0
writes a normal Hugging Face folder: the peft adapter, or the whole model, plus the tokenizer.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from zerofit.config.schema import CheckpointSection
from zerofit.strategies.base import Strategy

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"  # marker written last, by rank 0, after every rank's files are on disk
_STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `run_dir`, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = []
    for folder in root.glob("step-*") if root.is_dir() else []:
        match = _STEP_DIR.match(folder.name)
        if match and (folder / COMPLETE).is_file():
            found.append((int(match.group(1)), folder))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves every `checkpoint.every_steps` optimizer steps and at the end; resumes from the latest."""

    def __init__(self, strategy: Strategy, run_dir: Path, section: CheckpointSection, max_steps: int) -> None:
        self.strategy = strategy
        self.root = Path(run_dir) / CHECKPOINTS
        self.section = section
        self.max_steps = max_steps

    def after_step(self, steps_done: int) -> None:
        """Called by the loop after every optimizer step (on every rank)."""
        every = self.section.every_steps
        if steps_done == self.max_steps or (every and steps_done % every == 0):
            self.save(steps_done)

    def save(self, steps_done: int) -> Path:
        """Write checkpoint `step-<steps_done>` atomically (collective)."""
        rank = self.strategy.rank
        final = self.root / f"step-{steps_done}"
        tmp = self.root / f"step-{steps_done}.tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            tmp.mkdir(parents=True)
        self.strategy.barrier()
        self.strategy.save(tmp, {"step": steps_done})
        torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
        self.strategy.barrier()
        if rank == 0:
            (tmp / COMPLETE).write_text(f"{steps_done}\n")
            self._replace(tmp, final)
            self._prune()
        self.strategy.barrier()
        return final

    @staticmethod
    def _replace(tmp: Path, final: Path) -> None:
        # The old folder is moved aside before the new one takes its name, and deleted only afterwards.
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def _prune(self) -> None:
        for _, folder in complete_checkpoints(self.root.parent)[: -self.section.keep_last]:
            shutil.rmtree(folder, ignore_errors=True)

    def resume(self) -> int:
        """Restore the latest complete checkpoint; returns the optimizer steps already done (0 if none)."""
        folder = latest_checkpoint(self.root.parent)
        if folder is None:
            return 0
        client_state = self.strategy.load(folder)
        rng_file = folder / f"rng-rank{self.strategy.rank}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return int(client_state["step"])


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
    strategy.barrier()
    return out


def _fix_architectures(model: torch.nn.Module, folder: Path) -> None:
    # FSDP2 swaps the model's class for a generated `FSDP<Name>` subclass, which save_pretrained would
    # record as the architecture; write the real class name so the folder loads like any HF model.
    config_file = folder / "config.json"
    name = type(model).__name__
    if not config_file.is_file() or not name.startswith("FSDP"):
        return
    import json

    config = json.loads(config_file.read_text())
    config["architectures"] = [name.removeprefix("FSDP")]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
