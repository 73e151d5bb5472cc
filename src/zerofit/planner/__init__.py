"""Memory planning: model shapes, per-rank peak memory, GPU catalogue, the speed model and the search for
the fastest plan that fits (all analytic).

`choose_fastest_plan` is what `resolve()` is handed for every `auto` key (micro-batch, token budget,
activation checkpointing); it imports the search only when called, so resolving a config without `auto`
never pays for the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofit.config.rules.batch import PlanChoice
    from zerofit.config.schema import ZerofitConfig


def choose_fastest_plan(cfg: ZerofitConfig, world_size: int) -> PlanChoice:
    """The `auto` keys' values: the fastest (micro-batch, checkpointed layers) that fits the GPU and keeps
    the global batch (`zerofit.planner.search.auto.choose_plan`)."""
    from zerofit.planner.search.auto import choose_plan

    return choose_plan(cfg, world_size)
