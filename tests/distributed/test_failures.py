"""Failures a long run meets end cleanly on every rank (real 2-rank launches, gloo on CPU):

- a full disk mid-checkpoint (a real tmpfs; ZeRO-2 under `deepspeed`, FSDP2 under `torchrun`, W&B offline):
  one paragraph on every rank (folder, free space, what was kept, the fix), no traceback (W&B's logging
  included), the partial folder removed, and no rank left waiting in a barrier;
- the `deepspeed` runner killed alone: its `launch.py` and both ranks stop instead of training on unwatched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from full_disk import small_filesystem
from launch_helpers import REPO, Launch, RunResult, run_launches, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("failures")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i} ", "response": f"a{i}"}) + "\n" for i in range(32)))
    return write_config(
        root / "job.yaml",
        {
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "distributed": {"strategy": "deepspeed", "preset": "zero2"},
            "train": {"max_steps": 6, "precision": "fp32"},
            "lora": {"enabled": True, "r": 8, "alpha": 16},
            "data": {"path": str(data), "max_seq_len": 32},
            "checkpoint": {"every_steps": 2},
            "logging": {"console": False, "wandb": {"mode": "offline"}},
        },
    )


# Each engine writes its checkpoint its own way: DeepSpeed's checkpoint engine (its barriers around every
# rank's files), DCP (which gathers every rank's outcome itself).
ENGINES = {
    "zero2": ("deepspeed", ("distributed.strategy=deepspeed", "distributed.preset=zero2")),
    "fsdp": ("torchrun", ("distributed.strategy=fsdp",)),
}


@pytest.fixture(scope="module")
def full_disk_runs(config: Path) -> dict[str, tuple[RunResult, Path, list[str]]]:
    """Both engines' launches side by side, each with its output_dir on its own 400 KiB filesystem: it holds
    the run's small files but not a checkpoint (~650 KiB on ZeRO-2 here)."""
    with contextlib.ExitStack() as mounts:
        disks = {name: mounts.enter_context(small_filesystem(config.parent / name, 400)) for name in ENGINES}
        launches = [
            Launch(name, launcher, (*overrides, f"output_dir={disks[name]}"))
            for name, (launcher, overrides) in ENGINES.items()
        ]
        results = run_launches(launches, config, config.parent / "runs", timeout=300)
        # (result, run dir, what its checkpoints/ holds), read before the small disks are unmounted
        return {
            name: (
                result,
                disks[name] / name,
                sorted(p.name for p in (disks[name] / name / "checkpoints").iterdir()),
            )
            for name, result in results.items()
        }


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_full_disk_mid_checkpoint_is_one_paragraph_on_every_rank(
    full_disk_runs: dict[str, tuple[RunResult, Path, list[str]]], engine: str
) -> None:
    result, run_dir, leftovers = full_disk_runs[engine]
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    for rank in (0, 1):
        paragraph = f"zerofit (rank {rank}): error: checkpoint step-2 could not be written in {run_dir}"
        assert paragraph in out, out[-3000:]
    assert "No space left on device" in out or "could not write" in out
    assert "free of 400.0 KiB" in out
    assert "Kept: no checkpoint" in out and "the partial step-2.tmp was removed" in out
    # No traceback through zerofit's code or W&B's logging (torchrun prints one of its own for any exit 2).
    assert f'File "{REPO / "src"}' not in out and "Logging error" not in out, out[-3000:]
    if engine == "zero2":
        assert "Traceback" not in out, out[-3000:]
    assert leftovers == []


def test_killing_the_deepspeed_runner_alone_ends_launch_py_and_every_rank(
    config: Path, tmp_path: Path
) -> None:
    """Only the runner's pid is killed (not its process group): launch.py and the ranks are its descendants,
    not its children, so without a watch they train on (and would race a resume with their checkpoints)."""
    import psutil

    steps = 100_000  # far more than the wait below could train: on main the ranks are still training
    out = tmp_path / "runs"
    overrides = (f"train.max_steps={steps}", "checkpoint.every_steps=0")
    cmd = Launch("orphan", "deepspeed", overrides).command(config, out)
    own = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")  # the launch brings its own rendezvous
    env = {k: v for k, v in os.environ.items() if k not in own}
    with (tmp_path / "log").open("w") as log:
        runner = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        metrics = out / "orphan" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().strip()):
            log_tail = (tmp_path / "log").read_text()[-3000:]
            assert runner.poll() is None and time.monotonic() < deadline, log_tail
            time.sleep(0.05)
        descendants = psutil.Process(runner.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in descendants]
        assert sum("deepspeed.launcher.launch" in c for c in commands) == 1, commands
        assert sum("--local_rank=" in c for c in commands) == 2, commands
        os.kill(runner.pid, signal.SIGKILL)  # the runner only, as `kill -9 PID` does
        runner.wait()
        _, alive = psutil.wait_procs(descendants, timeout=60)  # a bound on the wait, not a speed requirement
        left = [" ".join(p.cmdline()) for p in alive if p.is_running()]
        assert not left, f"still running after the deepspeed runner was killed: {left}"
        assert len(metrics.read_text().splitlines()) < steps
        assert "the deepspeed launcher" in (tmp_path / "log").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)  # whatever a failed check left of the launch
