"""Everything `zerofit plan` reports about memory and speed for one config and budget (`plan_memory`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerofit.planner.estimate import MemoryEstimate, estimate
from zerofit.planner.scenario import scenario_for
from zerofit.planner.search.budget import Budget, verdict
from zerofit.planner.search.options import PlanOption, baseline_option, fastest_options, plan_option
from zerofit.planner.search.remedies import Remedy, remedies
from zerofit.planner.search.table import MicroRow, largest_fitting, micro_table
from zerofit.planner.speed import speed_levers

if TYPE_CHECKING:
    from zerofit.engine_spec.spec import EngineSpec
    from zerofit.resolution import ResolvedConfig


@dataclass
class MemoryPlan:
    """Everything `zerofit plan` reports about memory for one config and budget."""

    estimate: MemoryEstimate
    budget: Budget | None
    verdict: str | None
    table: list[MicroRow] = field(default_factory=list)
    remedies: list[Remedy] = field(default_factory=list)
    auto_micro_batch_size: int | None = None
    speed: SpeedPlan | None = None

    @property
    def fits(self) -> bool | None:
        """True when the configured micro-batch fits with headroom (None without a budget)."""
        return None if self.verdict is None else self.verdict == "fits"

    def as_dict(self) -> dict[str, Any]:
        """The `memory` block of `zerofit plan --json`."""
        out = self.estimate.as_dict()
        out.update(
            {
                "fits": self.fits,
                "verdict": self.verdict,
                "gpu": None
                if self.budget is None
                else {
                    "name": self.budget.gpu.name if self.budget.gpu else None,
                    "memory_gib": round(self.budget.gib, 2),
                    "source": self.budget.source,
                    "headroom_fraction": self.budget.headroom,
                    "limit_gib": round(self.budget.limit_gib, 2),
                },
                "headroom_gib": None
                if self.budget is None
                else round(self.budget.gib - self.estimate.total_gib, 3),
                "micro_batch_table": [row.as_dict() for row in self.table],
                "auto_micro_batch_size": self.auto_micro_batch_size,
                "remedies": [r.as_dict() for r in self.remedies],
                "speed": None if self.speed is None else self.speed.as_dict(),
            }
        )
        return out


@dataclass
class SpeedPlan:
    """The fastest plans under the budget (one per micro-batch, fastest first), the configured plan, and the
    baseline the speed-up is measured against (`baseline_option`)."""

    options: list[PlanOption]
    configured: PlanOption
    baseline: PlanOption | None
    # What the speed model assumed for the opt-in speed levers that are on (`speed.speed_levers`), or None.
    speed_levers: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The `memory.speed` block of `zerofit plan --json`."""
        chosen = self.options[0] if self.options else None
        runner_up = self.options[1] if len(self.options) > 1 else None
        base = self.baseline.speed.tokens_per_s if self.baseline else None
        return {
            "model": "t_micro = overhead + tokens x FLOPs/token (recompute included) / sustained rate",
            "rates_of": self.configured.speed.gpu,
            "reference_rates": self.configured.speed.reference,
            "chosen": chosen.as_dict() if chosen else None,
            "runner_up": runner_up.as_dict() if runner_up else None,
            "configured": self.configured.as_dict(),
            "baseline": self.baseline.as_dict() if self.baseline else None,
            "speedup_vs_baseline": round(chosen.speed.tokens_per_s / base, 3) if chosen and base else None,
            "configured_vs_baseline": round(self.configured.speed.tokens_per_s / base, 3) if base else None,
            "options": [o.as_dict() for o in self.options],
            "speed_levers": self.speed_levers,
        }


def plan_memory(resolved: ResolvedConfig, spec: EngineSpec, budget: Budget | None) -> MemoryPlan:
    """Estimate, verdict, micro-batch table, the fastest plans and (when it does not fit) remedies."""
    cfg, world = resolved.config, resolved.world_size
    per_rank = spec.batch.samples_per_rank
    configured = scenario_for(cfg, spec)
    table = micro_table(scenario_for(cfg, spec, 1, per_rank), per_rank, budget)
    auto = largest_fitting(table) if budget is not None else None
    est = estimate(configured)
    result = MemoryPlan(
        est, budget, verdict(est.total_gib, budget) if budget else None, table, auto_micro_batch_size=auto
    )
    if budget is not None:
        result.speed = SpeedPlan(
            options=fastest_options(configured, per_rank, budget),
            configured=plan_option(configured, budget),
            baseline=baseline_option(configured, per_rank, budget),
            speed_levers=speed_levers(configured),
        )
        if result.verdict != "fits":
            result.remedies = remedies(cfg, world, budget)
    return result
