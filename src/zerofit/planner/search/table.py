"""The micro-batch table: the predicted peak for every micro-batch size that divides the samples a rank
processes per optimizer step (the global batch stays fixed, so gradient accumulation stays whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerofit.config.rules.engine import data_parallel_size
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario
from zerofit.planner.search.budget import Budget, verdict

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


def samples_per_rank(cfg: ZerofitConfig, world_size: int) -> int | None:
    """Samples each rank processes per optimizer step (global / dp), when the config fixes the global batch
    (dp = world / `distributed.sequence_parallel`: a sequence-parallel group processes one rank's share)."""
    b, dp = cfg.batch, data_parallel_size(cfg, world_size)
    if b.global_batch_size is not None:
        if b.global_batch_size % dp:
            return None
        return b.global_batch_size // dp
    if isinstance(b.micro_batch_size, int) and b.grad_accum_steps:
        return b.micro_batch_size * b.grad_accum_steps
    return None


def divisors(n: int) -> list[int]:
    """All divisors of n, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@dataclass
class MicroRow:
    """One row of the micro-batch table."""

    micro_batch_size: int
    grad_accum_steps: int
    tensors_gib: float
    total_gib: float
    verdict: str | None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "tensors_gib": round(self.tensors_gib, 3),
            "total_gib": round(self.total_gib, 3),
            "verdict": self.verdict,
        }


def micro_table(scn: Scenario, per_rank: int, budget: Budget | None) -> list[MicroRow]:
    """The predicted peak for every micro-batch size that divides the per-rank samples."""
    rows = []
    for m in divisors(per_rank):
        est = estimate(scn.with_micro(m, per_rank // m))
        rows.append(
            MicroRow(
                m,
                per_rank // m,
                est.tensors_gib,
                est.total_gib,
                verdict(est.total_gib, budget) if budget else None,
            )
        )
    return rows


def largest_fitting(table: list[MicroRow]) -> int | None:
    """The largest micro-batch size whose verdict is `fits` (None if none fits)."""
    fitting = [row.micro_batch_size for row in table if row.verdict == "fits"]
    return max(fitting) if fitting else None
