"""The console sink (rank 0): a live progress bar on a terminal, compact lines elsewhere, a summary table.

On a terminal, rich shows one bar with ETA, step, loss, lr, tokens/s and peak memory. Under a launcher, in
CI or in tests stdout is not a terminal (deepspeed pipes its ranks' output), and a live bar would print
control codes; there it prints one compact line every `every` steps (and the first and last). At `close()`
it prints one table with the run's outcome, unless no step was logged in this launch (a run stopped by an
error before its first step never started training: a table of zeros would only bury the error).
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from zerofit.core.messages import said
from zerofit.metrics.keys import JUDGED_BY, LOSS, MAX_PEAK, REWARD
from zerofit.metrics.summary import RunSummary, predicted_peak_gib


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _status(metrics: dict[str, Any]) -> str:
    """`loss 2.3456  lr 2.0e-04  1,234 tok/s  peak 1.23 GiB` from one step's metrics (a GRPO step's mean
    reward after its loss: `reward 0.4375`)."""
    reward = f"reward {_fmt(metrics[REWARD], '.4f')}  " if REWARD in metrics else ""
    return (
        f"loss {_fmt(metrics.get('loss'), '.4f')}  {reward}lr {_fmt(metrics.get('lr'), '.2e')}  "
        f"{_fmt(metrics.get('tokens_per_s'), ',.0f')} tok/s  "
        f"peak {_fmt(metrics.get(MAX_PEAK), '.2f')} GiB"
    )


class ConsoleSink:
    """Progress on rank 0. `total_steps` is the run's `train.max_steps`; `every` applies off-terminal."""

    def __init__(
        self,
        total_steps: int,
        *,
        every: int | None = None,
        console: Console | None = None,
        title: str = "train",
    ) -> None:
        self.console = console or Console()
        self.total = max(1, int(total_steps))
        # About 20 lines for a whole run off-terminal: enough to follow, short enough to read in CI logs.
        self.every = every or max(1, self.total // 20)
        self.summary = RunSummary()
        self.title = title
        self._start = time.monotonic()
        self._closed = False
        self._logged = False  # a step logged in this launch (a resume's replayed rows are not)
        self._last_printed: int | None = None
        self._first: tuple[int, float] | None = None
        self._progress: Progress | None = None
        self._task: Any = None
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task(title, total=self.total, status="")
            self._progress.start()

    def resume_from(self, rows: list[dict[str, Any]], wall_s: float) -> None:
        """A resumed run: the earlier steps' rows and wall time count in the end-of-run table."""
        self.summary.replay(rows)
        self._start -= wall_s

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._logged = True
        self.summary.update(step, metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=min(step, self.total), status=_status(metrics))
            said()  # the bar moved: a progress line (`zerofit.core.progress`) is due only after a quiet interval
            return
        if self._first is None:
            self._first = (step, time.monotonic())
        # Whenever a multiple of `every` is reached or passed (works with any logging.log_every), plus the
        # first and last steps.
        last = self._last_printed
        if last is None or step // self.every > last // self.every or step >= self.total:
            self._last_printed = step
            self.console.print(
                f"step {step}/{self.total}  {_status(metrics)}  eta {self._eta(step)}",
                highlight=False,
                soft_wrap=True,
            )
            said()  # a progress line (`zerofit.core.progress`) is due only after a quiet interval

    def _eta(self, step: int) -> str:
        # From the pace since the first logged step (a resumed run starts late; step 1 includes warm-up).
        first_step, first_time = self._first or (step, time.monotonic())
        if step <= first_step:
            return "?"
        per_step = (time.monotonic() - first_time) / (step - first_step)
        return f"{per_step * max(0, self.total - step):.0f}s"

    def log_config(self, config: dict[str, Any]) -> None:
        self.summary.predicted_peak = predicted_peak_gib(config)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        if not self._logged:
            return  # no step logged in this launch (an error before the first one): no summary of nothing
        self.console.print(summary_table(self.summary.result(time.monotonic() - self._start), self.title))


def loss_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the loss ended: smoothed first (one batch's loss is noisy, so its last and lowest values beside
    each other read like a regression), the held-out loss when the run evaluates, then the raw values."""
    k = result.get("smoothed_loss_steps") or 1
    rows = [(f"loss, mean of the last {k} step(s)", _fmt(result.get("smoothed_loss"), ".4f"))]
    if result.get("eval_loss") is not None:
        rows.append(("held-out loss (eval/loss, last evaluation)", _fmt(result["eval_loss"], ".4f")))
    return [
        *rows,
        ("last step's loss (one batch)", _fmt(result.get("final_loss"), ".4f")),
        ("lowest step's loss (one batch)", _fmt(result.get("min_loss"), ".4f")),
    ]


def judged_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """What the run is judged by, where that is not the loss (the loss rows follow): `reward accuracy
    (rewards/accuracies), mean of the first -> last 10 step(s) | 0.5000 -> 1.0000` (`RunSummary.result`'s
    `judged_by`; the metric's name after its words where they differ)."""
    words = dict(pair for group in JUDGED_BY for pair in group)
    rows = []
    for key, trend in (result.get("judged_by") or {}).items():
        if key == LOSS:
            continue
        name = words.get(key, key) if words.get(key, key) == key else f"{words[key]} ({key})"
        first, last = _fmt(trend["first"], ".4f"), _fmt(trend["last"], ".4f")
        rows.append((f"{name}, mean of the first -> last {trend['steps']} step(s)", f"{first} -> {last}"))
    return rows


def summary_table(result: dict[str, Any], title: str = "run") -> Table:
    """One table of a run's outcome (see `RunSummary.result`)."""
    table = Table(title=f"zerofit: {title} summary", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    source = result.get("mem_source") or "?"
    rows: list[tuple[str, str]] = [
        ("optimizer steps", str(result.get("steps", 0))),
        *judged_rows(result),
        *loss_rows(result),
        ("tokens seen", _fmt(result.get("tokens_seen"), ",.0f")),
        ("mean tokens/s", _fmt(result.get("mean_tokens_per_s"), ",.1f")),
        (f"peak memory, max over ranks ({source})", _fmt(result.get("peak_gib"), ".3f") + " GiB"),
    ]
    rank = 0
    while f"peak_gib_rank{rank}" in result:
        rows.append((f"  rank {rank} peak", _fmt(result[f"peak_gib_rank{rank}"], ".3f") + " GiB"))
        rank += 1
    if (
        result.get("predicted_peak_gib") is not None and source == "cuda"
    ):  # comparable with device memory only
        rows.append(("planner predicted peak (tensors)", _fmt(result["predicted_peak_gib"], ".3f") + " GiB"))
    rows.append(("wall time", _fmt(result.get("wall_s"), ".1f") + " s"))
    for name, value in rows:
        table.add_row(name, value)
    return table
