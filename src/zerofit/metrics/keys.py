"""The names of `metrics.jsonl` fields that more than one module writes or reads (docs/contracts.md,
contract 4).

A field written in one module and read back in another (the evaluation writes `eval/loss`, the checkpoint
policy, the summary and `zerofit compare` read it; the memory telemetry writes `mem/rank{r}/peak_gib`, the
summary and the compare plots read it) is spelled here once, with the builder and the parser of the
per-rank names side by side, so a rename cannot leave a reader looking for the old name. No torch, no
rich: `zerofit compare` imports this.
"""

from __future__ import annotations

import re

__all__ = [
    "EVAL_LOSS",
    "MAX_PEAK",
    "MEM_SOURCE",
    "PEAK_GIB",
    "rank_field",
    "rank_of_field",
]

EVAL_LOSS = "eval/loss"  # the mean loss per target token over the held-out set (lower is better)
MEM_SOURCE = "mem/source"  # what the memory fields measure: `cuda` (allocator) or `cpu_rss` (process RSS)
MAX_PEAK = "mem/max_peak_gib"  # the largest peak of any rank in the logging interval
PEAK_GIB = "peak_gib"  # a rank's peak memory in the interval: the per-rank field `rank_field(r, PEAK_GIB)`

_MEM_RANK_PREFIX = "mem/rank"
_RANK_FIELD = re.compile(rf"^{re.escape(_MEM_RANK_PREFIX)}(\d+)/(.+)$")


def rank_field(rank: int, name: str) -> str:
    """`mem/rank{rank}/{name}`: the field of one rank's memory reading `name` (`rank_of_field` reads it)."""
    return f"{_MEM_RANK_PREFIX}{rank}/{name}"


def rank_of_field(key: str, name: str) -> int | None:
    """The rank `r` of a field `mem/rank{r}/{name}` (as `rank_field` builds it), else None."""
    match = _RANK_FIELD.match(key)
    return int(match.group(1)) if match and match.group(2) == name else None
