"""benchmarks/quality_vs_hf.py runs as a user runs it, at its smallest size (tiny-llama, 2 steps, 2 probes per
set), and HF's side of every zerofit-vs-HF benchmark trains as a plain one-process run.

Nothing here looks at the scores or times themselves (a 2-step tiny run learns nothing; tests never assert on
time): the script must exit 0, print its lines and write every field its results file documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _probes(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return path


@pytest.mark.slow
def test_quality_vs_hf_scores_both_trainers_and_writes_its_json(tmp_path: Path) -> None:
    task = _probes(tmp_path / "task.jsonl", [("What is 2+2?", "4"), ("Which animal says moo?", "cow")])
    facts = _probes(tmp_path / "facts.jsonl", [("What is the capital of France?", "Paris")])
    out = tmp_path / "quality.json"
    small = [
        "train.max_steps=2",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
        "data.max_seq_len=64",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, str(BENCH / "quality_vs_hf.py"), "--config", "configs/demo-chat.yaml", "--task",
         str(task), "--facts", str(facts), "--probes", "2", "--json", str(out), *small],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "zerofit / HF, cpu_s_per_step: " in result.stdout
    report = json.loads(out.read_text())
    assert report["run"]["steps"] == 2 and report["run"]["grad_accum"] == 2
    for name in ("base", "zerofit", "hf"):
        scored = report[name]
        assert scored["task_total"] == 2 and scored["facts_total"] == 1 and scored["heldout_label_tokens"] > 0
        assert scored["heldout_loss"] > 0
    assert len(report["zerofit"]["losses"]) == 2
    # zerofit trained first and exported its one-process rendezvous variables: HF must not see them.
    assert report["hf"]["process_group"] is False
    assert set(report["ratios_zerofit_over_hf"]) == {"wall_s_per_step", "cpu_s_per_step", "heldout_loss"}


def test_hf_side_trains_without_the_one_process_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """zerofit's `launch_env` exports RANK=0 / WORLD_SIZE=1 / LOCAL_RANK=0 / MASTER_* into a plain `python`
    process; HF's Trainer would then wrap its model in a one-rank DDP. `train_hf` hides them while it runs and
    puts them back; a real multi-rank launch's variables stay."""
    monkeypatch.syspath_prepend(str(BENCH))
    from hf_baseline import _without_one_process_rendezvous
    from zerofit.strategies.env import launch_env

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    for key in keys:
        monkeypatch.delenv(key, raising=False)
    launch_env()
    exported = {key: os.environ[key] for key in keys}
    with _without_one_process_rendezvous():
        assert not any(key in os.environ for key in keys)
    assert {key: os.environ[key] for key in keys} == exported
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with _without_one_process_rendezvous():
        assert os.environ["WORLD_SIZE"] == "2" and os.environ["RANK"] == "1"
