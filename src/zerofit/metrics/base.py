"""The logger protocol and the sinks every run has.

Rank 0 logs; other ranks get a `NullSink`, so the training loop never branches on rank to log.
`step` is always the optimizer step (never the micro-step): it is the x-axis of every metric.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from zerofit.core.messages import warn


@runtime_checkable
class MetricsSink(Protocol):
    """Where per-step metrics go."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record `metrics` for optimizer step `step`."""

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the run's resolved configuration (once, before the first step)."""

    def close(self) -> None:
        """Flush and release resources; safe to call twice."""


@runtime_checkable
class TableSink(Protocol):
    """A sink that also records tables (W&B): rows of one step under a key (GRPO's sampled completions)."""

    def log_table(self, step: int, key: str, rows: list[dict[str, Any]]) -> None:
        """Record `rows` (one dict per row, the same keys in each) as table `key` at optimizer step `step`."""


class NullSink:
    """Discards everything (non-zero ranks, or logging disabled)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        del step, metrics

    def log_config(self, config: dict[str, Any]) -> None:
        del config

    def close(self) -> None:
        pass


def _jsonable(value: Any) -> Any:
    # NaN/inf are not JSON; write null so every line stays parseable by strict readers.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# What `plottable` returns for a value that is no number (a label such as mem/source).
NOT_NUMERIC = object()


def plottable(value: Any) -> Any:
    """A row's value as a tracker plots it: a number (bools and numpy scalars as Python numbers), None for
    NaN/inf (metrics.jsonl writes null: nothing to plot), or `NOT_NUMERIC` (a label: the trackers' summary,
    tags or text, not a series). The one rule of every tracker sink (W&B, TensorBoard, MLflow)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):  # numpy ints too
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return NOT_NUMERIC


class JsonlSink:
    """Appends one JSON object per logged step to `metrics.jsonl` (docs/contracts.md), flushed each line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exc:
            raise named(exc, self.path) from exc

    def log_config(self, config: dict[str, Any]) -> None:
        del config  # config.yaml in the run directory holds it

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def named(exc: OSError, path: Path) -> OSError:
    """`exc` with the file it failed to write: a failed `write`/`flush` of an open file carries no name, and
    the user must be told which file (and so which filesystem) is full."""
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), str(path))


class MultiSink:
    """Fans every call out to several sinks."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks
        self.write_failed = (
            False  # a log failed to write (a full disk): the loop reports it, close stays quiet
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        try:
            for sink in self.sinks:
                sink.log(step, metrics)
        except OSError:
            self.write_failed = True
            raise

    def log_config(self, config: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_config(config)

    def log_table(self, step: int, key: str, rows: list[dict[str, Any]]) -> None:
        """Hand the table to every sink that records tables (`TableSink`); the others have no place for it."""
        for sink in self.sinks:
            if isinstance(sink, TableSink):
                sink.log_table(step, key, rows)

    def close(self) -> None:
        """Close every sink, even when one fails to write (a full disk): that is a warning, and it must not
        hide the error that ended the run (the close runs while that error is propagating). After a failed
        `log` the run's error paragraph has said so already: no second word about the same full disk."""
        for sink in self.sinks:
            try:
                sink.close()
            except OSError as exc:
                if not self.write_failed:
                    warn(f"the run's metrics files could not be finished: {exc}")
