"""The runs the page lists and watches: every run folder in the workspace (a run started from a terminal
included), read from the files the run writes (docs/contracts.md, run directory): `config.yaml`,
`metrics.jsonl`, `summary.json`, GRPO's `completions.jsonl`, and the `.zerofit.lock` its rank 0 holds while it
runs. `RunWatch` turns them into the page's live stream: new metrics rows (all of them again after a resume
rewound the file), progress and ETA, new completions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zerofit.catalogue.gpus import get_gpu
from zerofit.checkpoint.rundir import locked_by
from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from zerofit.metrics.keys import MEM_SOURCE, judged_by
from zerofit.metrics.rows import read_rows
from zerofit.studio.security import Workspace

_SKIPPED = {".git", ".venv", "node_modules", "__pycache__", ".zerofit-studio"}
ETA_WINDOW = 20  # the last rows whose step time predicts the rest
# Run folders this deep under the workspace: output_dir/run_name, output_dir a folder or two down.
SEARCH_DEPTH = 3


def find_runs(workspace: Workspace) -> list[Path]:
    """Every run folder (a `config.yaml` beside a `metrics.jsonl`, or a config alone while a run starts) under
    the workspace, newest first."""
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        for child in sorted(folder.iterdir()) if folder.is_dir() else []:
            if not child.is_dir() or child.name in _SKIPPED or child.name.startswith("."):
                continue
            if (child / CONFIG_FILE).is_file() and depth > 0:
                found.append(child)
            elif depth < SEARCH_DEPTH:
                walk(child, depth + 1)

    walk(workspace.root, 0)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml (empty if unreadable: a launch may be writing it)."""
    try:
        return yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def run_state(run_dir: Path) -> str:
    """`running` (its rank 0 holds the lock), `finished` (summary.json says it ran to its end), else
    `stopped` (a signal, a failure, or not started yet)."""
    if locked_by(run_dir) is not None:
        return "running"
    try:
        reason = json.loads((run_dir / SUMMARY_FILE).read_text()).get("stop_reason")
    except (OSError, ValueError, AttributeError):
        return "stopped"
    return "stopped" if reason is None or str(reason).startswith("SIG") else "finished"


def rows_by_step(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics rows, the last of each step, in step order (a torn last line left out)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    by_step = {row["step"]: row for row in read_rows(path).rows}
    return [by_step[s] for s in sorted(by_step)]


def progress(rows: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """Step of max_steps, and the ETA from the mean step time of the last `ETA_WINDOW` rows."""
    total = (config.get("train") or {}).get("max_steps")
    step = rows[-1]["step"] if rows else 0
    times = [r["step_time_s"] for r in rows[-ETA_WINDOW:] if isinstance(r.get("step_time_s"), (int, float))]
    eta = None
    if total and times:
        eta = round(max(total - step, 0) * sum(times) / len(times), 1)
    return {"step": step, "max_steps": total, "eta_s": eta}


def judged(rows: list[dict[str, Any]]) -> list[list[str]]:
    """What the run is judged by ([key, words] pairs: loss; reward; reward accuracy; KL), from its rows."""
    return [list(pair) for pair in judged_by({key for row in rows for key in row})]


def card_gib(rows: list[dict[str, Any]], config: dict[str, Any]) -> float | None:
    """The card's memory each rank's curve is drawn against: the planner's GPU of the run's config, for a run
    that measures GPU memory (`mem/source` cuda; a CPU run's RSS has no card)."""
    if not rows or rows[-1].get(MEM_SOURCE) != "cuda":
        return None
    planner = config.get("planner") or {}
    if planner.get("gpu_memory_gib"):
        return float(planner["gpu_memory_gib"])
    try:
        return get_gpu(planner["gpu"]).memory_gib if planner.get("gpu") else None
    except ConfigError:
        return None


@dataclass
class RunWatch:
    """One page's view of a run: what it was sent so far, so each poll sends only what is new."""

    run_dir: Path
    sent_step: int = 0
    completions_offset: int = 0
    last: dict[str, Any] = field(default_factory=dict)

    def poll(self, state: str) -> list[tuple[str, Any]]:
        """The events due now: `rows` (new rows; `reset` with every row after a rewind), `status`
        (state, progress, what the run is judged by), `completions` (new sampled completions)."""
        rows = rows_by_step(self.run_dir)
        events: list[tuple[str, Any]] = []
        newest = rows[-1]["step"] if rows else 0
        if newest < self.sent_step:
            events.append(("reset", rows))
        elif newest > self.sent_step:
            events.append(("rows", [r for r in rows if r["step"] > self.sent_step]))
        self.sent_step = newest
        config = run_config(self.run_dir)
        status = {
            "state": state,
            **progress(rows, config),
            "judged_by": judged(rows),
            "card_gib": card_gib(rows, config),
        }
        if status != self.last:
            events.append(("status", status))
            self.last = status
        completions = self._new_completions()
        if completions:
            events.append(("completions", completions))
        return events

    def _new_completions(self) -> list[dict[str, Any]]:
        """Whole new lines of completions.jsonl since the last poll."""
        from zerofit.loop.rollout import COMPLETIONS_FILE  # GRPO's sampled completions

        path = self.run_dir / COMPLETIONS_FILE
        if not path.is_file():
            return []
        with path.open("rb") as f:
            f.seek(self.completions_offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        self.completions_offset += len(whole)
        out = []
        for line in whole.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out
