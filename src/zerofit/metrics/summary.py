"""The outcome of a run in a few numbers, computed from the per-step metrics stream.

One accumulator serves the W&B summary, the console's end-of-run table and `zerofit compare` (which feeds
it the rows of `metrics.jsonl`), so the three always agree on what "final loss" or "mean tokens/s" means.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.core.messages import warn
from zerofit.core.run_layout import RunLayout
from zerofit.metrics.base import named
from zerofit.metrics.keys import EVAL_LOSS, JUDGED_BY, LOSS, MEM_SOURCE, PEAK_GIB, judged_by, rank_of_field

_JUDGED_KEYS = tuple(dict.fromkeys(key for group in JUDGED_BY for key, _ in group))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def predicted_peak_gib(run_config: dict[str, Any]) -> float | None:
    """The planner's predicted per-rank peak (GiB) recorded in a run's config, if any.

    Prefers the tensor peak (`tensors_gib`: comparable to the measured `peak_gib`, which is the CUDA
    allocator's max allocated), then a flat `peak_gib`, then the total with allowance; accepts the
    prediction flat or under a `memory` key.
    """
    planner = run_config.get("planner_prediction")
    if not isinstance(planner, dict):
        return None
    for source in (planner.get("memory"), planner):
        if isinstance(source, dict):
            for key in ("tensors_gib", "peak_gib", "total_gib"):
                value = _number(source.get(key))
                if value is not None:
                    return value
    return None


def next_tokens_seen(seen: float, row: dict[str, Any]) -> float:
    """The tokens seen through `row`, given `seen` through the rows before it: the row's own running count
    (`tokens_seen`, every step counted) where it has one, else `seen` plus its `tokens` (older run folders,
    whose rows under `logging.log_every` > 1 leave steps out)."""
    exact = _number(row.get("tokens_seen"))
    return exact if exact is not None else seen + (_number(row.get("tokens")) or 0.0)


def tokens_seen_through(rows: list[dict[str, Any]]) -> float:
    """The tokens seen through the last of `rows` (a resumed run's kept rows), see `next_tokens_seen`."""
    seen = 0.0
    for row in rows:
        seen = next_tokens_seen(seen, row)
    return seen


def loss_window(logged: int) -> int:
    """How many of the last logged steps a smoothed loss averages: half the run, at most 10, at least 1.

    One global batch's loss is noisy (a step's few hundred tokens): its last value, or its lowest, says
    little about where the run ended; the mean of the last few steps does.
    """
    return max(1, min(10, logged // 2))


@dataclass(frozen=True)
class Trend:
    """Where one metric a run is judged by (`keys.JUDGED_BY`) started and ended: the means of its first and
    its last `steps` values (`loss_window`: one step's value is one batch's, noisy)."""

    key: str
    words: str
    first: float
    last: float
    steps: int

    def describe(self) -> str:
        """`reward 0.1562 -> 0.9563`."""
        return f"{self.words} {self.first:.4f} -> {self.last:.4f}"

    def record(self) -> dict[str, Any]:
        """Its entry in summary.json's `judged_by`."""
        return {"first": self.first, "last": self.last, "steps": self.steps}


def judged_series(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    """The finite values, in order, of every `JUDGED_BY` metric that `rows` (metrics rows) carry."""
    series: dict[str, list[float]] = {}
    for row in rows:
        for key in _JUDGED_KEYS:
            value = _number(row.get(key))
            if value is not None:
                series.setdefault(key, []).append(value)
    return series


def judged_trends(series: Mapping[str, Sequence[float]]) -> list[Trend]:
    """The trends of the metrics the run is judged by (`keys.judged_by` of what `series` holds)."""
    trends = []
    for key, words in judged_by({key for key, values in series.items() if values}):
        values = series.get(key) or []
        if values:
            k = loss_window(len(values))
            trends.append(Trend(key, words, sum(values[:k]) / k, sum(values[-k:]) / k, k))
    return trends


def describe_trends(trends: Sequence[Trend]) -> str:
    """`reward 0.1562 -> 0.9563 (mean of the first / last 10 steps)`: the closing line's account of a run."""
    windows = {t.steps for t in trends}
    if len(windows) == 1:
        return f"{', '.join(t.describe() for t in trends)} (mean of the first / last {windows.pop()} steps)"
    return ", ".join(f"{t.describe()} (mean of the first / last {t.steps} steps)" for t in trends)


class RunSummary:
    """Accumulates per-step metrics into the run's outcome.

    - `final_loss` / `min_loss`: last and lowest logged `loss`; `eval_loss` / `min_eval_loss`: the same of
      `eval/loss` (None for a run without evaluation data). `smoothed_loss`: the mean `loss` of the last
      `smoothed_loss_steps` logged steps (`loss_window`), where the run ended without one batch's noise.
    - `peak_gib_rank{r}` and `peak_gib`: the largest `mem/rank{r}/peak_gib` of each rank and over all ranks.
    - `mean_tokens_per_s`: mean of `tokens_per_s` over logged steps, leaving out the first one when there
      are several (it includes warm-up: kernel compilation, allocator growth, JIT of DeepSpeed ops).
    - `tokens_seen`: valid label tokens trained on since step 0, the last row's `tokens_seen` (exact: the
      loop counts every step, logged or not); rows without it (run folders older than the field) add up
      their `tokens`, which misses the unlogged steps under `logging.log_every` > 1. `wall_s`: first to
      last log.
    - `steps`: the optimizer steps done, the `step` of the last logged row (a row's `step` is the steps done,
      and the last step of a run is always logged), not the number of rows: with `logging.log_every` > 1,
      or a resumed run whose earlier rows were rewound or torn, those differ.
    - `judged_by`: what the run is judged by (`keys.JUDGED_BY`: GRPO's reward, a preference run's reward
      accuracy and margin, KTO's KL, else the loss), each metric's `first` and `last` mean over `steps`
      logged values (`Trend`).
    - `predicted_peak_gib` (planner, tensors) and, on CUDA, `measured_peak_gib` and their ratio.
    """

    def __init__(self, predicted_peak: float | None = None) -> None:
        self.predicted_peak = predicted_peak
        self.logged_rows = 0  # rows folded in (fewer than `steps` under logging.log_every > 1)
        self.last_step: int | None = None
        self.final_loss: float | None = None
        self.min_loss: float | None = None
        self.losses: list[float] = []
        self.eval_loss: float | None = None
        self.min_eval_loss: float | None = None
        self.tokens_seen = 0.0
        self.rank_peaks: dict[int, float] = {}
        self.throughputs: list[float] = []
        self.mem_source: str | None = None
        self.last_lr: float | None = None
        self.judged: dict[str, list[float]] = {}  # every `JUDGED_BY` metric's values, in order
        self._first_time: float | None = None
        self._last_time: float | None = None

    def update(self, step: int, metrics: dict[str, Any], now: float | None = None) -> None:
        """Fold one logged step into the summary."""
        now = time.monotonic() if now is None else now
        if self._first_time is None:
            self._first_time = now
        self._last_time = now
        self.logged_rows += 1
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        loss = _number(metrics.get(LOSS))
        if loss is not None:
            self.final_loss = loss
            self.losses.append(loss)
            self.min_loss = loss if self.min_loss is None else min(self.min_loss, loss)
        eval_loss = _number(metrics.get(EVAL_LOSS))
        if eval_loss is not None:
            self.eval_loss = eval_loss
            self.min_eval_loss = (
                eval_loss if self.min_eval_loss is None else min(self.min_eval_loss, eval_loss)
            )
        for key, values in judged_series([metrics]).items():
            self.judged.setdefault(key, []).extend(values)
        self.tokens_seen = next_tokens_seen(self.tokens_seen, metrics)
        tps = _number(metrics.get("tokens_per_s"))
        if tps is not None:
            self.throughputs.append(tps)
        lr = _number(metrics.get("lr"))
        if lr is not None:
            self.last_lr = lr
        if isinstance(metrics.get(MEM_SOURCE), str):
            self.mem_source = metrics[MEM_SOURCE]
        for key, value in metrics.items():
            rank = rank_of_field(key, PEAK_GIB)
            peak = _number(value)
            if rank is not None and peak is not None:
                self.rank_peaks[rank] = max(self.rank_peaks.get(rank, 0.0), peak)

    def replay(self, rows: list[dict[str, Any]]) -> None:
        """Fold earlier rows of `metrics.jsonl` in (a resumed run: the summary covers the whole run)."""
        for row in rows:
            self.update(int(row["step"]), row)

    @property
    def measured_peak(self) -> float | None:
        """The largest per-rank peak seen over the whole run (GiB)."""
        return max(self.rank_peaks.values()) if self.rank_peaks else None

    @property
    def mean_tokens_per_s(self) -> float | None:
        values = self.throughputs[1:] if len(self.throughputs) > 1 else self.throughputs
        return sum(values) / len(values) if values else None

    @property
    def smoothed_loss(self) -> tuple[float | None, int]:
        """The mean loss of the last `loss_window` logged steps, and how many that is."""
        k = loss_window(len(self.losses))
        return (sum(self.losses[-k:]) / k if self.losses else None), min(k, len(self.losses))

    def result(self, wall_s: float | None = None) -> dict[str, Any]:
        """The summary as a flat dict (None where unknown)."""
        if wall_s is None and self._first_time is not None and self._last_time is not None:
            wall_s = self._last_time - self._first_time
        out: dict[str, Any] = {
            "steps": self.last_step or 0,
            "last_step": self.last_step,
            "final_loss": self.final_loss,
            "min_loss": self.min_loss,
            "smoothed_loss": self.smoothed_loss[0],
            "smoothed_loss_steps": self.smoothed_loss[1],
            "eval_loss": self.eval_loss,
            "min_eval_loss": self.min_eval_loss,
            "judged_by": {t.key: t.record() for t in judged_trends(self.judged)},
            "tokens_seen": self.tokens_seen,
            "mean_tokens_per_s": self.mean_tokens_per_s,
            "peak_gib": self.measured_peak,
            "mem_source": self.mem_source,
            "wall_s": wall_s,
        }
        for rank in sorted(self.rank_peaks):
            out[f"peak_gib_rank{rank}"] = self.rank_peaks[rank]
        if self.predicted_peak is not None:
            out["predicted_peak_gib"] = self.predicted_peak
            # Only device memory is comparable with the planner's tensor peak; process RSS (CPU runs)
            # also holds the interpreter, libraries and host copies.
            if self.mem_source == "cuda" and self.measured_peak:
                out["measured_peak_gib"] = self.measured_peak
                out["predicted_over_measured"] = self.predicted_peak / self.measured_peak
        return out


class RunFilesSink:
    """Writes `run_info.json` (the logged config extras) and `summary.json` (at close) into the run dir.

    `metrics.jsonl` holds the steps; these two small files let `zerofit compare` show versions, the
    planner prediction and the run's outcome without W&B.
    """

    def __init__(self, run_dir: str | Path, predicted_peak: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.summary = RunSummary(predicted_peak)
        self._start = time.monotonic()
        self._closed = False

    def resume_from(self, rows: list[dict[str, Any]], wall_s: float) -> None:
        """A resumed run: the earlier steps' rows and wall time count in the summary."""
        self.summary.replay(rows)
        self._start -= wall_s

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.summary.update(step, metrics)

    def log_config(self, config: dict[str, Any]) -> None:
        if self.summary.predicted_peak is None:
            self.summary.predicted_peak = predicted_peak_gib(config)
        _write_json(RunLayout(Path(self.run_dir)).run_info, config)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _write_json(
            RunLayout(Path(self.run_dir)).summary, self.summary.result(time.monotonic() - self._start)
        )


def record_outcome(run_dir: str | Path, fields: dict[str, Any]) -> None:
    """Add how the run ended (`stop_reason`, `early_stopped`, `best_step`, `best_eval_loss` or `best_eval_reward`) to the
    `summary.json` the sinks wrote at close (rank 0, after the loop).

    A write that fails (a full disk) is a warning: the run trained, checkpointed and exported already, and
    raising here would leave the other ranks waiting for rank 0 at the run's last barrier."""
    path = RunLayout(Path(run_dir)).summary
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    try:
        _write_json(path, {**summary, **fields})
    except OSError as exc:
        warn(f"how the run ended could not be added to {path}: {named(exc, path)}")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # no half-written .tmp left on the full disk
        raise named(exc, path) from exc
    tmp.replace(path)  # atomic: a crash never leaves half a file for `compare` to choke on
