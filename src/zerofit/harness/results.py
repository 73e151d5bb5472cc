"""Where lm-eval's scores of a run go: `eval/harness-step-N.json` (everything lm-eval said, base and trained),
a row of `metrics.jsonl` (`harness/<task>/<metric>`, `metrics.keys.harness_field`) and the W&B run's summary.

During training the scores join the step's own row, as `eval/loss` does (the loop's sinks write it, and W&B
history with it). After training (`zerofit eval`) the step's training row is already written: the scores go
in a row of their own for that step, marked `posthoc`, appended to the file; readers lay it over the
training row (`metrics.rows.one_row_per_step`: `zerofit compare`, a resume's rewind), so the file keeps one
step per row as they read it, and a later post-hoc row of the same step overrides the earlier scores.
W&B's history cannot go back to an earlier step, so a post-hoc score goes to the run's summary (the same W&B
run id, resumed; offline when the run logged offline) and never fails the evaluation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerofit.core.messages import say
from zerofit.core.run_layout import RunLayout
from zerofit.metrics.keys import POSTHOC, harness_field

__all__ = ["append_posthoc_row", "score_fields", "update_wandb_summary", "write_results"]

# Seconds W&B may take to start before the summary update is given up (as the training sink's init).
WANDB_TIMEOUT_S = 30.0


def score_fields(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """The `metrics.jsonl` / W&B fields of `{task: {metric: value}}`: `harness/<task>/<metric>`."""
    return {
        harness_field(task, metric): value
        for task, metrics in scores.items()
        for metric, value in metrics.items()
    }


def write_results(run_dir: Path, step: int | None, report: dict[str, Any]) -> Path:
    """`report` as `eval/harness-step-N.json` of `run_dir` (written whole, then renamed into place)."""
    path = RunLayout(Path(run_dir)).harness(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def append_posthoc_row(run_dir: Path, step: int, fields: dict[str, float]) -> Path:
    """A `posthoc` row of `fields` for `step`, appended to `run_dir`'s `metrics.jsonl` (one write, flushed)."""
    path = RunLayout(Path(run_dir)).metrics
    line = json.dumps({"step": step, POSTHOC: True, **fields}) + "\n"
    with path.open("a", encoding="utf-8") as out:
        out.write(line)
        out.flush()
        os.fsync(out.fileno())
    return path


def _wandb_section(config: dict[str, Any]) -> dict[str, Any]:
    logging = config.get("logging") if isinstance(config.get("logging"), dict) else {}
    section = logging.get("wandb") if isinstance(logging, dict) else None
    return section if isinstance(section, dict) else {}


def update_wandb_summary(
    run_dir: Path, config: dict[str, Any], fields: dict[str, Any], notice: Callable[[str], None] = say
) -> bool:
    """`fields` into the summary of the W&B run `run_dir` logged to (its recorded id, resumed; the mode its
    `config` recorded). False, with a notice, when the run has no W&B run or W&B cannot take it."""
    layout = RunLayout(Path(run_dir))
    wb = _wandb_section(config)
    mode = wb.get("mode")
    if mode not in ("online", "offline") or not layout.wandb_run_id.is_file():
        return False
    try:
        import wandb

        run = wandb.init(
            id=layout.wandb_run_id.read_text().strip(),
            resume="allow",
            mode=mode,
            dir=str(layout.root),
            project=wb.get("project"),
            entity=wb.get("entity"),
            job_type="eval",
            settings=wandb.Settings(init_timeout=WANDB_TIMEOUT_S, console="off", silent=True),
        )
        run.summary.update(fields)
        run.finish()
        wandb.teardown()  # the run file is complete when this returns (see metrics.wandb_sink)
    except Exception as exc:  # no network, a bad key: the scores are in the JSON and metrics.jsonl already
        notice(f"zerofit: W&B summary not updated ({type(exc).__name__}: {str(exc).strip()[:200]})")
        return False
    return True
