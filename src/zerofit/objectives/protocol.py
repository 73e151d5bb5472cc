"""What the train step and the evaluation need of a built objective (`ObjectiveSpec.build_loss`).

The train step (`zerofit.loop.train.train_step`) and the evaluation (`zerofit.loop.evaluate`) see an objective as

    before_window(...)      anything the whole global batch decides before any backward (KTO's reference
                            point z0; nothing for the others);
    counts(micro_batches)   this rank's normalizers (ints), all-reduced once over the global batch before
                            any backward;
    terms(model, ...)       one micro-batch's differentiable *sums*, one per normalizer, and the detached
                            per-unit sums of the metrics (`metrics`);
    metric_means(...)       the metrics row's fields from the global batch's metric sums;

and the global loss is sum_k term_k / count_k. So nothing depends on the split: every sum is over the
micro-batch's own units, every normalizer is the whole global batch's (docs/design.md).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = ["Batch", "Objective", "Reducing", "UnitMeans", "means_of"]

Batch = dict[str, torch.Tensor]


class Reducing(Protocol):
    """What a whole-window pass needs of the strategy (`zerofit.strategies.base.Strategy`)."""

    device: torch.device

    def accumulate(self, is_last: bool) -> AbstractContextManager[Any]: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


class Objective(Protocol):
    """A built objective (module docstring)."""

    metrics: tuple[str, ...]  # names of the per-unit metric sums `terms` returns (empty for SFT)

    def before_window(
        self, strategy: Reducing, model: torch.nn.Module, micro_batches: list[Batch], impl: str
    ) -> None: ...

    def counts(self, micro_batches: list[Batch]) -> list[int]: ...

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]: ...

    def metric_means(self, sums: list[float], units: int, prefix: str = "") -> dict[str, Any]: ...


def means_of(names: tuple[str, ...], sums: list[float], units: int, prefix: str = "") -> dict[str, Any]:
    """The metrics row's fields: each per-unit sum over the global batch's units."""
    return {prefix + name: value / max(units, 1) for name, value in zip(names, sums, strict=True)}


class UnitMeans:
    """The defaults of an objective whose global batch decides nothing before the window and whose metrics
    are means over its units (its last count): every objective but KTO."""

    metrics: tuple[str, ...] = ()

    def before_window(
        self, strategy: Reducing, model: torch.nn.Module, micro_batches: list[Batch], impl: str
    ) -> None:
        """Nothing to decide over the whole window."""

    def metric_means(self, sums: list[float], units: int, prefix: str = "") -> dict[str, Any]:
        """Each metric sum over the global batch's units."""
        return means_of(self.metrics, sums, units, prefix)
