"""The names of `metrics.jsonl` fields that more than one module writes or reads (docs/contracts.md,
metrics.jsonl).

A field written in one module and read back in another (the evaluation writes `eval/loss`, the checkpoint
policy, the summary and `zerofit compare` read it; the memory telemetry writes `mem/rank{r}/peak_gib`, the
summary and the compare plots read it) is spelled here once, with the builder and the parser of the
per-rank names side by side, so a rename cannot leave a reader looking for the old name. No torch, no
rich: `zerofit compare` imports this.
"""

from __future__ import annotations

import re
from collections.abc import Container

__all__ = [
    "EVAL_LOSS",
    "EVAL_REWARD",
    "HARNESS_PREFIX",
    "JUDGED_BY",
    "LOSS",
    "MAX_PEAK",
    "MEM_SOURCE",
    "PEAK_GIB",
    "POSTHOC",
    "REWARD",
    "harness_field",
    "harness_task_metric",
    "judged_by",
    "rank_field",
    "rank_of_field",
]

LOSS = "loss"  # the objective's loss over the global batch
REWARD = "reward"  # an RL step's mean reward over its completions (GRPO's; a metric, not the reward-model objective)

EVAL_LOSS = "eval/loss"  # the mean loss per target token over the held-out set (lower is better)
# lm-eval's scores (`zerofit eval`, `eval.harness`): `harness/<task>/<metric>`, higher is better for the shipped
# tasks' `acc`; each task's lm-eval config says which way its metrics go.
HARNESS_PREFIX = "harness/"
# A row that `zerofit eval` appends after training, for a step that already has its training row: readers lay
# its fields over that row (`zerofit.metrics.rows.one_row_per_step`) instead of replacing it.
POSTHOC = "posthoc"
EVAL_REWARD = (
    "eval/reward"  # an RL run's mean reward over its held-out prompts' completions (higher is better)
)
MEM_SOURCE = "mem/source"  # what the memory fields measure: `cuda` (allocator) or `cpu_rss` (process RSS)
MAX_PEAK = "mem/max_peak_gib"  # the largest peak of any rank in the logging interval
PEAK_GIB = "peak_gib"  # a rank's peak memory in the interval: the per-rank field `rank_field(r, PEAK_GIB)`

_MEM_RANK_PREFIX = "mem/rank"
_RANK_FIELD = re.compile(rf"^{re.escape(_MEM_RANK_PREFIX)}(\d+)/(.+)$")


def harness_field(task: str, metric: str) -> str:
    """`harness/<task>/<metric>`: one lm-eval score (`harness_task_metric` reads it back)."""
    return f"{HARNESS_PREFIX}{task}/{metric}"


def harness_task_metric(key: str) -> tuple[str, str] | None:
    """(task, metric) of a field `harness/<task>/<metric>`, else None."""
    if not key.startswith(HARNESS_PREFIX):
        return None
    task, _, metric = key[len(HARNESS_PREFIX) :].rpartition("/")
    return (task, metric) if task and metric else None


def rank_field(rank: int, name: str) -> str:
    """`mem/rank{rank}/{name}`: the field of one rank's memory reading `name` (`rank_of_field` reads it)."""
    return f"{_MEM_RANK_PREFIX}{rank}/{name}"


def rank_of_field(key: str, name: str) -> int | None:
    """The rank `r` of a field `mem/rank{r}/{name}` (as `rank_field` builds it), else None."""
    match = _RANK_FIELD.match(key)
    return int(match.group(1)) if match and match.group(2) == name else None


# What a run is judged by, read from the metrics its rows carry, not from its objective's name: the first group
# whose first metric the rows have; each metric with the words the closing line and the summary table use.
# The end of a run (`done: ...`, the summary table, summary.json's `judged_by`) shows the group's metrics.
JUDGED_BY: tuple[tuple[tuple[str, str], ...], ...] = (
    # GRPO: the mean reward of the step's completions (its on-policy loss is ~0 by construction)
    ((REWARD, "reward"),),
    # DPO, SimPO, ORPO and reward models: how often the chosen response wins, and by how much
    (("rewards/accuracies", "reward accuracy"), ("rewards/margins", "reward margin")),
    # KTO (it logs no accuracy): its KL reference point z0, the policy's drift from the reference
    (("kl", "KL"),),
    # SFT, and any run without the metrics above
    ((LOSS, "loss"),),
)


def judged_by(logged: Container[str]) -> tuple[tuple[str, str], ...]:
    """The `JUDGED_BY` group of a run whose rows carry the metrics `logged` ((key, words) pairs)."""
    return next((group for group in JUDGED_BY if group[0][0] in logged), JUDGED_BY[-1])
