"""Atomic checkpoints, keep_last and resume, through a one-process strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.checkpoint import COMPLETE, Checkpointer, complete_checkpoints, latest_checkpoint
from zerofit.config.schema import CheckpointSection
from zerofit.strategies.single import SingleStrategy


def _strategy() -> SingleStrategy:
    torch.manual_seed(0)
    strategy = one_process_strategy()
    strategy.prepare(
        torch.nn.Linear(3, 3),
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.1),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
    )
    return strategy


def _train_one_step(strategy: SingleStrategy) -> None:
    strategy.backward(strategy.unwrap()(torch.ones(2, 3)).pow(2).sum())
    strategy.clip_and_step(None)


def test_save_is_atomic_and_keeps_the_last_n(tmp_path: Path) -> None:
    strategy = _strategy()
    ckpt = Checkpointer(strategy, tmp_path, CheckpointSection(every_steps=2, keep_last=2), max_steps=7)
    for step in range(1, 8):
        _train_one_step(strategy)
        ckpt.after_step(step)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6, 7]  # every 2, the end, keep 2
    assert all((folder / COMPLETE).is_file() for _, folder in complete_checkpoints(tmp_path))
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_a_half_written_checkpoint_is_ignored(tmp_path: Path) -> None:
    strategy = _strategy()
    ckpt = Checkpointer(strategy, tmp_path, CheckpointSection(), max_steps=10)
    good = ckpt.save(3)
    (tmp_path / "checkpoints" / "step-5.tmp").mkdir()  # a crash mid-save
    (tmp_path / "checkpoints" / "step-6").mkdir()  # no COMPLETE marker
    assert latest_checkpoint(tmp_path) == good


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    strategy = _strategy()
    ckpt = Checkpointer(strategy, tmp_path, CheckpointSection(), max_steps=10)
    ckpt.save(4)
    (tmp_path / "checkpoints" / "step-4" / "stale").write_text("x")
    ckpt.save(4)
    assert not (tmp_path / "checkpoints" / "step-4" / "stale").exists()
    assert (tmp_path / "checkpoints" / "step-4" / COMPLETE).is_file()


def test_resume_restores_model_optimizer_scheduler_rng_and_step(tmp_path: Path) -> None:
    strategy = _strategy()
    ckpt = Checkpointer(strategy, tmp_path, CheckpointSection(), max_steps=10)
    for _ in range(2):
        _train_one_step(strategy)
    ckpt.save(2)
    expected_rng = torch.rand(3)
    _train_one_step(strategy)
    expected_weight = strategy.unwrap().weight.detach().clone()

    fresh = _strategy()
    assert Checkpointer(fresh, tmp_path, CheckpointSection(), max_steps=10).resume() == 2
    assert torch.equal(torch.rand(3), expected_rng)
    assert fresh.current_lr() == pytest.approx(0.1 / 3)
    _train_one_step(fresh)
    assert torch.equal(fresh.unwrap().weight, expected_weight)


def test_resume_without_checkpoint_starts_at_zero(tmp_path: Path) -> None:
    assert Checkpointer(_strategy(), tmp_path, CheckpointSection(), max_steps=3).resume() == 0
