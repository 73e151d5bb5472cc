"""The verbs the training loop needs from an engine, and nothing more.

The loop owns the gradient-accumulation arithmetic (token-normalized loss, one clip, one step per window);
a strategy only says how to run backward, when to synchronize gradients, and how to step, save and load on
its engine. See "Gradient accumulation, done right" in DESIGN.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch


class Strategy(ABC):
    """An engine (DeepSpeed, FSDP2, DDP or one process) behind the verbs of the training loop."""

    rank: int
    world_size: int
    device: torch.device

    @abstractmethod
    def prepare(self, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> torch.nn.Module:
        """Wrap the model (and take ownership of optimizer and scheduler); returns the module to call."""

    @abstractmethod
    def accumulate(self, is_last: bool) -> AbstractContextManager[None]:
        """Context for one micro-step; gradients are synchronized only when `is_last` (where the engine allows)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of an already token-normalized loss; the engine must not rescale it by GAS or dp."""

    @abstractmethod
    def clip_and_step(self, max_grad_norm: float | None) -> float:
        """After the window: global grad norm (before clipping), clip, optimizer step, scheduler step, zero grad."""

    @abstractmethod
    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of `value` over all data-parallel ranks (returns a new tensor)."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """`obj` from every rank, in rank order (small payloads: per-rank memory stats)."""

    @abstractmethod
    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        """Save engine state (model, optimizer, scheduler, `client_state`) into `directory`."""

    @abstractmethod
    def load(self, directory: Path) -> dict[str, Any]:
        """Restore engine state from `directory`; returns the saved `client_state`."""

    @abstractmethod
    def unwrap(self) -> torch.nn.Module:
        """The underlying (peft/HF) model, for export."""

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""

    def close(self) -> None:
        """Tear down process groups; safe to call twice."""

    @abstractmethod
    def current_lr(self) -> float:
        """Learning rate of the first parameter group after the last scheduler step."""
