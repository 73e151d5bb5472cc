"""A resumed run's `metrics.jsonl`, brought back to the step it resumes from.

A run killed after its last checkpoint logged steps the resume trains again, and a kill mid-write leaves a
torn last line. `rewind_metrics` keeps one row per step up to the resumed step (the last row written for
it, with the scores a post-hoc `zerofit eval` row added to it: `rows.one_row_per_step`), drops everything else, and rewrites the file atomically, so the file again has exactly one row per
step and the resumed steps append after it. The kept rows seed the end-of-run summary, which then covers
the whole run rather than the resumed part.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerofit.core.messages import warn
from zerofit.metrics.rows import one_row_per_step, read_rows, skipped_text

__all__ = ["rewind_metrics"]


def rewind_metrics(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the rows of steps 1..`step` of `path` (if it exists), rewrite it, and return them in step order."""
    if not path.is_file():
        return []
    found = read_rows(path)
    # A torn last line is what a kill leaves (the step is re-logged if it is resumed past); more is worth a word.
    if found.skipped:
        warn(f"{path}: dropped while rewinding to step {step}: {skipped_text(found.skipped)}")
    rows = one_row_per_step([row for row in found.rows if row["step"] <= step])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)
    return rows
