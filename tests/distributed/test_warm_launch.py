"""The `warm` launcher (tests/warm_launch.py) runs a launch as `torchrun` does: the same worker environment,
the same training to the bit, the same output files and exit code; a failing rank stops the others.

The launch modules run the rest of their equivalence matrices `warm` (one run per property through the real
launcher it claims): this is what lets them. One ZeRO-2 job of 2 steps on the tiny Llama (fp32, LoRA with
dropout, so the RNG streams count too), twice, and a job whose data file is missing:

    launch           launcher   what
    torchrun         torchrun   the reference
    warm             warm       the same job: identical metrics (all but timings), adapter and output
    warm-refused     warm       a missing data file: exit 2 with the one-paragraph error, no traceback
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from launch_helpers import BIN, Launch, RunResult, free_port, run_launches, varied_length_data, write_config
from warm_launch import torchrun_worker_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# What may differ between two runs of one training: its speeds and times, and its processes' memory.
VARYING = ("_per_s", "_time_s")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("warm")
    config = write_config(
        root / "job.yaml",
        {
            "seed": 5,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 4, "micro_batch_size": 1},
            "distributed": {"strategy": "deepspeed", "preset": "zero2"},
            "train": {"max_steps": 2, "precision": "fp32"},
            "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1},
            "data": {"path": str(varied_length_data(root / "data.jsonl", 8, seed=1)), "max_seq_len": 64},
            "logging": {"wandb": {"mode": "disabled"}},
        },
    )
    missing = f"data.path={root / 'missing.jsonl'}"
    launches = [
        Launch("torchrun", "torchrun"),
        Launch("warm", "warm"),
        Launch("warm-refused", "warm", (missing,)),
    ]
    return run_launches(launches, config, root / "runs")


def _without_timings(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in row.items() if not k.endswith(VARYING) and not k.startswith("mem/")} for row in rows
    ]


def test_a_warm_launch_trains_exactly_as_torchrun(runs: dict[str, RunResult]) -> None:
    real, warm = runs["torchrun"].check(), runs["warm"].check()
    assert len(real.metrics) == 2
    assert _without_timings(warm.metrics) == _without_timings(real.metrics)
    a, b = real.exported(), warm.exported()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert warm.stdout.count("zerofit plan") == real.stdout.count("zerofit plan") == 1  # rank 0's output


def test_a_warm_launch_reports_a_user_error_as_the_launched_rank_does(runs: dict[str, RunResult]) -> None:
    refused = runs["warm-refused"]
    assert refused.returncode == 2
    assert "missing.jsonl" in refused.stderr and "Traceback" not in refused.stderr + refused.stdout


def test_a_warm_rank_gets_the_environment_torchrun_gives_its_worker(tmp_path: Path) -> None:
    """torchrun's own worker environment (a script that imports nothing) against `torchrun_worker_env`, but
    for the two variables that name torchrun's agent: its error file, and that it hosts the store."""
    script = tmp_path / "env.py"
    script.write_text("import json, os\nprint(json.dumps(dict(os.environ)))\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [str(BIN / "torchrun"), "--master_port", str(port), "--nproc_per_node", "2", str(script)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    workers = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=_rank)
    assert len(workers) == 2
    for rank, worker in enumerate(workers):
        ours = torchrun_worker_env(env, rank, 2, port)
        for key in ("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"):
            worker.pop(key, None)
            ours.pop(key, None)
        assert worker == ours


def _rank(worker: dict[str, str]) -> int:
    return int(worker["RANK"])
