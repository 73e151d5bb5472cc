"""Memory planning: model shapes, per-rank peak memory, GPU catalogue, micro-batch search (all analytic).

`choose_micro_batch` is what `resolve()` is handed for `batch.micro_batch_size=auto`; it imports the
search only when called, so resolving an integer micro-batch never pays for the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


def choose_micro_batch(cfg: ZerofitConfig, world_size: int) -> int:
    """`batch.micro_batch_size=auto`: the largest micro-batch that fits and divides global / dp."""
    from zerofit.planner.search import choose_auto_micro_batch

    return choose_auto_micro_batch(cfg, world_size)
