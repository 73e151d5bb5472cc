"""A real 2-rank DeepSpeed run with W&B left unset and no API key: it falls back to offline, and the offline
run file, read back without network, holds exactly what metrics.jsonl holds (loss of every step, lr,
tokens/s, memory of both ranks) plus the batch plan in its config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch_helpers import free_port
from zerofit.metrics.wandb_reader import WandbRun, read_wandb_run

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The demo config for 4 steps on 2 CPU ranks, with `logging.wandb.mode` removed (unset)."""
    root = tmp_path_factory.mktemp("wandb-e2e")
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config.get("logging", {}).get("wandb", {}).pop("mode", None)
    config_path = root / "wandb-e2e.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = dict(os.environ)
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    env["NETRC"] = str(root / "no-netrc")  # no key anywhere: resolve() must pick offline
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [
        str(deepspeed),
        "--master_port",
        str(free_port()),
        "--num_gpus",
        "2",
        str(REPO / "launchers" / "launch_finetune.py"),
        "--config",
        str(config_path),
        f"train.max_steps={STEPS}",
        f"output_dir={root / 'runs'}",
        f"data.path={REPO / 'data' / 'demo.jsonl'}",
        "checkpoint.save_final=false",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (root / "runs").iterdir()
    return run_dir, proc


@pytest.fixture(scope="module")
def rows(offline_run: tuple[Path, Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (offline_run[0] / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def wandb_run(offline_run: tuple[Path, Any]) -> WandbRun:
    (run_file,) = (offline_run[0] / "wandb").glob("offline-run-*/run-*.wandb")
    return read_wandb_run(run_file)


def test_unset_mode_without_key_runs_offline_with_a_notice(offline_run: tuple[Path, Any]) -> None:
    _, proc = offline_run
    notices = [line for line in proc.stdout.splitlines() if "W&B logging offline" in line]
    assert len(notices) == 1, "exactly one notice, from rank 0"
    assert (
        yaml.safe_load((offline_run[0] / "config.yaml").read_text())["logging"]["wandb"]["mode"] == "offline"
    )


def test_every_step_in_wandb_equals_metrics_jsonl(rows: list[dict[str, Any]], wandb_run: WandbRun) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert sorted(wandb_run.history) == [r["step"] for r in rows]
    tokens_seen = 0
    for row in rows:
        logged = wandb_run.history[row["step"]]
        tokens_seen += row["tokens"]
        assert logged["train/step"] == row["step"]
        assert logged["train/tokens_seen"] == tokens_seen
        for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "samples_per_s", "step_time_s"):
            assert logged[key] == row[key], key  # exact: the same float went to both sinks
        for rank in (0, 1):
            for name in ("allocated_gib", "reserved_gib", "peak_gib", "rss_gib", "peak_rss_gib"):
                key = f"mem/rank{rank}/{name}"
                assert row[key] > 0 and logged[key] == row[key], key
        assert logged["mem/max_peak_gib"] == max(row["mem/rank0/peak_gib"], row["mem/rank1/peak_gib"])
    assert rows[0]["mem/source"] == "cpu_rss" and wandb_run.summary["mem/source"] == "cpu_rss"


def test_wandb_config_and_summary(rows: list[dict[str, Any]], wandb_run: WandbRun) -> None:
    cfg = wandb_run.config
    assert cfg["batch_plan"] == {
        "global_batch_size": 16,
        "micro_batch_size": 4,
        "grad_accum_steps": 2,
        "dp_size": 2,
    }
    assert cfg["distributed"]["preset"] == "zero2" and cfg["train"]["max_steps"] == STEPS
    assert cfg["versions"]["deepspeed"] and cfg["versions"]["torch"]
    assert "git" in cfg
    assert cfg["engine_config"]["train_micro_batch_size_per_gpu"] == 4
    assert wandb_run.group == "wandb-e2e"  # the config file's stem: the experiment
    assert wandb_run.name == "zero2-g16-m4x2x2"  # preset + split
    summary = wandb_run.summary
    assert summary["summary/final_loss"] == rows[-1]["loss"]
    assert summary["summary/peak_gib"] == max(
        max(r["mem/rank0/peak_gib"], r["mem/rank1/peak_gib"]) for r in rows
    )
    assert summary["summary/peak_gib_rank1"] == max(r["mem/rank1/peak_gib"] for r in rows)
    assert summary["summary/mean_tokens_per_s"] > 0
