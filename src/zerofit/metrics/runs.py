"""Load a finished (or running) run from disk for comparison: its config, per-step rows and outcome.

Sources, in order of trust: `config.yaml` (the fully resolved config, docs/contracts.md) and
`metrics.jsonl` (docs/contracts.md, metrics.jsonl); `run_info.json` / `summary.json` (written by the metrics sinks) for extras;
and, when `metrics.jsonl` is absent, the W&B run file under `wandb/`, read offline, else TensorBoard's event
files (`tensorboard/`, or a folder of them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerofit.config.loader import read_config_file
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import DataError
from zerofit.core.messages import warn
from zerofit.core.run_layout import METRICS_FILE, RunLayout
from zerofit.metrics.keys import PEAK_GIB, rank_of_field
from zerofit.metrics.rows import one_row_per_step, read_rows, skipped_text
from zerofit.metrics.summary import RunSummary, next_tokens_seen, predicted_peak_gib
from zerofit.metrics.tensorboard_reader import event_dir
from zerofit.metrics.wandb_reader import WANDB_RUN_GLOB

# The optimizer-step column of W&B history rows (see wandb_sink.STEP_METRIC).
_W_AND_B_STEP = "train/step"


@dataclass
class LoadedRun:
    """One run as `zerofit compare` sees it."""

    path: Path
    label: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    source: str  # "metrics.jsonl", "wandb" or "tensorboard"
    extra: dict[str, Any] = field(default_factory=dict)  # run_info.json (versions, planner, params...)
    saved_summary: dict[str, Any] = field(default_factory=dict)  # summary.json, if the run finished

    def summary(self) -> dict[str, Any]:
        """The run's outcome (see `RunSummary`), wall time from `summary.json` or the logged step times."""
        acc = RunSummary(predicted_peak_gib(self.extra) or predicted_peak_gib(self.config))
        for row in self.rows:
            acc.update(int(row.get("step", 0)), row, now=0.0)
        wall = self.saved_summary.get("wall_s")
        if wall is None:
            times = [r["step_time_s"] for r in self.rows if _is_num(r.get("step_time_s"))]
            wall = sum(times) if times else None
        result = acc.result()
        result["wall_s"] = wall  # the rows carry no clock; only summary.json or step times know it
        return result

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """`(xs, ys)` of rows that have numeric `key`; `x="tokens_seen"`: the rows' running count (older
        rows without it: their `tokens` added up, see `next_tokens_seen`)."""
        xs: list[float] = []
        ys: list[float] = []
        seen = 0.0
        for row in self.rows:
            seen = next_tokens_seen(seen, row)
            value = row.get(key)
            if _is_num(value):
                xs.append(seen if x == "tokens_seen" else float(row.get(x, len(xs) + 1)))
                ys.append(float(value))
        return xs, ys

    def ranks(self) -> list[int]:
        """Ranks with memory fields in the rows (`mem/rank{r}/peak_gib`)."""
        found = {rank_of_field(key, PEAK_GIB) for row in self.rows for key in row}
        return sorted(rank for rank in found if rank is not None)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl`, one per step (`one_row_per_step`), in step order. A line that is no metrics
    row (no UTF-8, no JSON, no whole-number step) is left out with one warning naming the file and the line;
    a file with lines but not one row is a DataError (it is no zerofit metrics file)."""
    found = read_rows(path)
    if found.skipped and found.rows:
        n = len(found.skipped)
        warn(
            f"{path}: skipped {n} line{'s' if n > 1 else ''} that {'are' if n > 1 else 'is'} no metrics row "
            f"({skipped_text(found.skipped)}); comparing the file's other rows"
        )
    if not found.rows and (found.skipped or found.torn):
        raise DataError(
            f"{path} holds no usable metrics row ({skipped_text([*found.skipped, *filter(None, [found.torn])])}): every row of a zerofit "
            "metrics.jsonl is a JSON object with a whole-number step, one per line; pass the folder of a run "
            "zerofit wrote, or leave this one out"
        )
    # A resumed run appends, `zerofit eval` adds post-hoc scores: one row per step, in step order.
    return one_row_per_step(found.rows)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable, no UTF-8 or no JSON: a folder from elsewhere
        return {}
    return data if isinstance(data, dict) else {}


def _rows_from_wandb(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from zerofit.metrics.wandb_reader import read_wandb_run

    run = read_wandb_run(path)
    rows = []
    for step, row in sorted(run.history.items()):
        clean = {k: v for k, v in row.items() if not k.startswith("_")}
        clean["step"] = int(row.get(_W_AND_B_STEP, step))
        rows.append(clean)
    return rows, run.config


def _rows_elsewhere(path: Path) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """A folder without metrics.jsonl: the rows, source and logged config of its W&B run file, else of its
    TensorBoard event files (the folder's own or its `tensorboard/`)."""
    folder = event_dir(path) if path.is_dir() else None
    if folder is None or any(path.rglob(WANDB_RUN_GLOB)):
        try:
            rows, wandb_config = _rows_from_wandb(path)
            return rows, "wandb", wandb_config
        except FileNotFoundError:
            pass
    if folder is None:
        raise DataError(
            f"{str(path)!r} has neither metrics.jsonl, a W&B run file (wandb/*/run-*.wandb) nor TensorBoard "
            "event files (tensorboard/events.out.tfevents.*); is it a zerofit run directory?"
        )
    from zerofit.metrics.tensorboard_reader import read_tensorboard_run

    rows, config = read_tensorboard_run(folder)
    return rows, "tensorboard", config


def _config_part(run_config: dict[str, Any]) -> dict[str, Any]:
    """The user-config keys of a sinks' run config (which adds plan, versions, commit, loop extras)."""
    return {k: v for k, v in run_config.items() if k in ZerofitConfig.model_fields}


def load_run(path: str | Path) -> LoadedRun:
    """Load a run directory (or a W&B offline run folder / `.wandb` file) for `zerofit compare`."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"run directory {str(path)!r} does not exist; pass run directories such as runs/<run_name> "
            "(each holds config.yaml and metrics.jsonl)"
        )
    run_dir = path if path.is_dir() else path.parent
    layout = RunLayout(run_dir)
    config: dict[str, Any] = {}
    if layout.config.is_file():
        config = read_config_file(layout.config)  # a folder from elsewhere: UTF-8, a mapping, bounded
    extra = _read_json(layout.run_info)
    if not config and extra:
        config = _config_part(extra)
    metrics = layout.metrics
    if path.is_dir() and metrics.is_file():
        rows, source = _read_jsonl(metrics), METRICS_FILE
    else:
        rows, source, logged = _rows_elsewhere(path)
        config = config or _config_part(logged)
        extra = extra or logged
    label = str(config.get("run_name") or run_dir.name)
    return LoadedRun(
        path=run_dir,
        label=label,
        config=config,
        rows=rows,
        source=source,
        extra=extra,
        saved_summary=_read_json(layout.summary),
    )
