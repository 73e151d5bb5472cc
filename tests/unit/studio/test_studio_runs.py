"""What the watch page is streamed from a run folder's files: new metrics rows only (all again after a resume
rewound the file), the state, progress and ETA, what the run is judged by, and new sampled completions."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from zerofit.studio.runs import RunWatch, run_state


def write_rows(run: Path, steps: range, **extra: float) -> None:
    rows = [{"step": s, "loss": 3.0 - 0.1 * s, "step_time_s": 2.0, **extra} for s in steps]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_watch_streams_new_rows_a_rewind_progress_and_completions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": 10}}))
    write_rows(run, range(1, 4))
    watch = RunWatch(run)
    first = dict(watch.poll("running"))
    assert [r["step"] for r in first["rows"]] == [1, 2, 3]
    assert first["status"] == {
        "state": "running",
        "step": 3,
        "max_steps": 10,
        "eta_s": 14.0,
        "judged_by": [["loss", "loss"]],
        "card_gib": None,
    }
    assert watch.poll("running") == []  # nothing new, nothing sent
    write_rows(run, range(1, 6))
    assert [r["step"] for r in dict(watch.poll("running"))["rows"]] == [4, 5]
    write_rows(run, range(1, 3), reward=0.5)  # a resume rewound the file to step 2; a GRPO run's rows
    events = dict(watch.poll("running"))
    assert [r["step"] for r in events["reset"]] == [1, 2]
    assert events["status"]["judged_by"] == [["reward", "reward"]]
    with (run / "completions.jsonl").open("w") as f:
        f.write(json.dumps({"step": 2, "completion": "42"}) + "\n" + '{"step": 2, "compl')  # a torn last line
    assert dict(watch.poll("running"))["completions"] == [{"step": 2, "completion": "42"}]
    assert watch.poll("running") == []


def test_a_run_is_finished_only_when_its_summary_says_it_ran_to_its_end(tmp_path: Path) -> None:
    assert run_state(tmp_path) == "stopped"
    (tmp_path / "summary.json").write_text(json.dumps({"stop_reason": "SIGINT"}))
    assert run_state(tmp_path) == "stopped"
    (tmp_path / "summary.json").write_text(json.dumps({"stop_reason": "max_steps"}))
    assert run_state(tmp_path) == "finished"
