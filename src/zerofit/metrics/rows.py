"""Reading `metrics.jsonl` (docs/contracts.md, metrics.jsonl) as data that may come from elsewhere.

A run folder may be copied, truncated, or not be a zerofit run at all: a line may be no UTF-8, no JSON, no
JSON object, or a row whose `step` is no whole number >= 1. `read_rows` keeps the usable rows and names each
line it skips (its number and why), so a reader can say which lines it left out instead of failing on the
first one (`zerofit compare`) or rewind past them (a resume, `zerofit.metrics.history`). The last line without
its newline is a write in progress or cut short by a kill (`torn`): expected, so not counted as damage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerofit.metrics.keys import POSTHOC

__all__ = ["MetricsLines", "one_row_per_step", "read_rows", "skipped_text"]

# How many skipped lines a message names one by one; the rest are counted.
NAMED_LINES = 3


@dataclass
class MetricsLines:
    """What `read_rows` found: the usable rows in file order, each skipped line as (its number, why), and
    the last line when it is no row and has no newline after it (`torn`: a write cut short, not among
    `skipped`)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    torn: tuple[int, str] | None = None


def _step_problem(row: Any) -> str | None:
    """Why a parsed line is no metrics row (None: it is one)."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        shown = repr(step) if len(repr(step)) <= 40 else repr(step)[:39] + "…"
        return f"its step is {shown}, not a whole number >= 1" if "step" in row else "it has no step"
    return None


def _parse(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One line as a metrics row, or why it is none."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return None, "not a metrics row (JSON nested too deep to read)"
    problem = _step_problem(row)
    return (None, problem) if problem else (row, None)


def read_rows(path: Path) -> MetricsLines:
    """Every line of `path` that is a metrics row, and every other non-blank line's number and reason."""
    found = MetricsLines()
    lines = path.read_bytes().split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        row, problem = _parse(raw)
        if row is not None:
            found.rows.append(row)
        elif number == len(lines):  # no newline after it: a write cut short
            found.torn = (number, f"{problem}, with no newline after it")
        else:
            found.skipped.append((number, str(problem)))
    return found


def skipped_text(skipped: list[tuple[int, str]]) -> str:
    """`line 3: not valid JSON (...); line 7: ...` for the first `NAMED_LINES`, then how many more."""
    named = "; ".join(f"line {number}: {why}" for number, why in skipped[:NAMED_LINES])
    more = len(skipped) - NAMED_LINES
    return named + (f"; and {more} more line{'s' if more > 1 else ''}" if more > 0 else "")


def one_row_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, in step order: the last training row written for each step (a resumed run may have
    logged a step twice), with the fields of any post-hoc row of that step (`POSTHOC`: `zerofit eval`'s
    scores, appended after training) laid over it rather than replacing it."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        step, before = row["step"], by_step.get(row["step"])
        if row.get(POSTHOC) and before is not None:
            by_step[step] = {**before, **{k: v for k, v in row.items() if k != POSTHOC}}
        else:
            by_step[step] = row
    return [by_step[s] for s in sorted(by_step)]
