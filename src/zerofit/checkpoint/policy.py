"""When an overnight run saves and when it stops early: the wall-clock save interval and the eval/loss watch.

Both are pure bookkeeping; the decisions that must be the same on every rank (a timed save is due, this
evaluation is the best so far, the patience has run out) are taken by rank 0 and agreed through the loop's
one all-reduce after every step (`zerofit.loop.train.agree_after_step`), so no rank's clock or float rounding
can make ranks disagree about a collective save or stop.

    SaveClock  `checkpoint.every_minutes`: due once that much wall time has passed since the last save
    EvalWatch  `checkpoint.keep_best` and `train.early_stopping`: the best evaluation so far (its step's
               checkpoint is kept beyond `keep_last`) and how many evaluations have passed without an
               improvement of more than `min_delta`

The evaluation followed is the objective's (`followed_metric`): `eval/loss`, lower is better, for the
objectives scored on held-out labels; `eval/reward`, higher is better, for an RL objective (its held-out
prompts' sampled completions, `zerofit.loop.held_out`); or, with `eval.harness.best_metric`, that lm-eval
score, higher is better. `checkpoints/best.json` names it (`metric`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import BEST_FILE, RunLayout, step_dir_name
from zerofit.metrics.keys import EVAL_LOSS, EVAL_REWARD
from zerofit.objectives.spec import ObjectiveSpec

HIGHER_IS_BETTER = frozenset({EVAL_REWARD})  # the followed metrics where a larger value is the better one


def followed_metric(objective: ObjectiveSpec) -> str:
    """The evaluation metric the best checkpoint and early stopping follow for `objective`: an RL
    objective's held-out reward (`ObjectiveSpec.rewarded`), else the held-out loss."""
    return EVAL_REWARD if objective.rewarded else EVAL_LOSS


class SaveClock:
    """Says a save is due once `every_minutes` of wall time passed since the last one (None or 0: never)."""

    def __init__(self, every_minutes: float | None, now: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = (every_minutes or 0.0) * 60.0
        self._now = now
        self._last = now()

    def due(self) -> bool:
        """Whether the interval has passed (this process's clock: only rank 0's counts)."""
        return self.interval_s > 0 and self._now() - self._last >= self.interval_s

    def reset(self) -> None:
        """A checkpoint was just written (for any reason): the interval starts again."""
        self._last = self._now()


@dataclass(frozen=True)
class Verdict:
    """What one evaluation means: a new best (its checkpoint is kept), and whether the patience ran out."""

    best: bool
    exhausted: bool


class EvalWatch:
    """The best value of `metric` so far and the early-stopping patience (`patience` 0: never stops).

    An evaluation improves when its value beats the best by more than `min_delta` (lower for `eval/loss`,
    higher for a metric of `HIGHER_IS_BETTER` or with `higher`, as `eval.harness.best_metric`'s lm-eval score;
    the first one always improves); an improvement is the new
    best and resets the count of evaluations without one; the run stops after `patience` evaluations in a
    row without one.
    """

    def __init__(
        self, patience: int = 0, min_delta: float = 0.0, metric: str = EVAL_LOSS, higher: bool | None = None
    ) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.metric = metric
        self.higher = metric in HIGHER_IS_BETTER if higher is None else higher  # an lm-eval score: True
        self.best_step: int | None = None
        self.best_value: float | None = None
        self.since_best = 0  # evaluations since the best one
        self.stopped_at: int | None = None  # the step early stopping ended the run after

    def judge(self, value: float) -> Verdict:
        """What an evaluation with `value` would mean (no state change: rank 0 judges, every rank records)."""
        if not math.isfinite(value):
            best = False
        elif self.best_value is None:
            best = True
        elif self.higher:
            best = value > self.best_value + self.min_delta
        else:
            best = value < self.best_value - self.min_delta
        exhausted = self.patience > 0 and not best and self.since_best + 1 >= self.patience
        return Verdict(best, exhausted)

    def record(self, step: int, value: float, verdict: Verdict) -> None:
        """Take the (agreed) verdict on the evaluation after step `step`."""
        if verdict.best:
            self.best_step, self.best_value, self.since_best = step, value, 0
        else:
            self.since_best += 1
        if verdict.exhausted:
            self.stopped_at = step

    def replay(self, rows: Iterable[dict[str, Any]]) -> None:
        """A resumed run: the evaluations in the kept rows of metrics.jsonl, in order, as if just seen."""
        for row in rows:
            value = row.get(self.metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                verdict = self.judge(float(value))
                self.record(int(row["step"]), float(value), Verdict(verdict.best, False))

    @property
    def summary_field(self) -> str:
        """summary.json's field of the best value: `best_eval_loss`, or `best_eval_reward`."""
        return "best_" + self.metric.replace("/", "_")

    def stop_line(self) -> str:
        """The one line that says why the run ended early."""
        return (
            f"early stopping: {self.metric} has not improved by more than {self.min_delta:g} for "
            f"{self.patience} evaluation(s) (best {self.best_value:.4f} at step {self.best_step}); "
            f"stopped after step {self.stopped_at}"
        )


def write_best(checkpoints: Path, step: int, value: float, metric: str = EVAL_LOSS) -> Path:
    """Record the best evaluation (of `metric`) in `checkpoints/best.json` (atomically: a crash leaves the
    old record)."""
    path = Path(checkpoints) / BEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    record = {"step": step, "metric": metric, "value": value, "checkpoint": step_dir_name(step)}
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_best(checkpoints: Path) -> dict[str, Any] | None:
    """`checkpoints/best.json` as written by `write_best`, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads((Path(checkpoints) / BEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def resolve_step(run_dir: Path, step: int | str | None) -> int | None:
    """`--step best` as the step number `checkpoints/best.json` names; numbers and None pass through."""
    if step != "best":
        return step if isinstance(step, int) or step is None else int(step)
    layout = RunLayout(Path(run_dir))
    record = read_best(layout.checkpoints)
    folder = layout.checkpoint(record["step"]) if record else None
    if record is None or folder is None or not folder.is_dir():
        why = "has no checkpoints/best.json" if record is None else f"no longer holds {folder}"
        raise ConfigError(
            [
                f"--step best: {run_dir} {why}; the best checkpoint is kept by runs with evaluation data "
                "(data.eval_path or data.eval_split) and checkpoint.keep_best=true; pass --step N for a "
                "checkpoint the run has, or leave --step out for the newest weights"
            ]
        )
    return int(record["step"])
