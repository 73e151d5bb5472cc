"""launchers/compare_presets.sh: one launch per preset x micro-batch, one W&B group, then `zerofit compare`.

The real launchers are replaced by a stand-in `deepspeed`/`torchrun` that records its command line and
writes a synthetic run, so the sweep logic is checked in seconds; the real 2-rank path is covered by
tests/e2e.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "launchers" / "compare_presets.sh"

FAKE_LAUNCHER = """#!{python}
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from metrics_fixtures import make_run
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps([Path(sys.argv[0]).name] + args) + "\\n")
over = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
if over.get("distributed.preset") == "zero3" and over.get("batch.micro_batch_size") == "1":
    sys.exit(3)  # one failing run: the sweep must go on and report it
make_run(Path(over["output_dir"]), over["run_name"], preset=over.get("distributed.preset", "zero2"))
"""


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "zerofit"):
        # Wrappers, not symlinks: a symlinked venv python outside the venv folder loses the venv.
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{Path(sys.executable).parent / name}" "$@"\n')
        (bin_dir / name).chmod(0o755)
    script = FAKE_LAUNCHER.format(
        python=sys.executable, tests=str(Path(__file__).parents[1]), log=str(tmp_path / "launches.jsonl")
    )
    for name in ("deepspeed", "torchrun"):
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _sweep(tmp_path: Path, fake_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VENV_BIN": str(fake_bin), "SWEEP_DIR": str(tmp_path / "runs"), "COLUMNS": "150"}
    return subprocess.run(
        ["bash", str(SCRIPT), "--config", str(REPO / "configs" / "demo.yaml"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_sweep_launches_each_combination_into_one_group_and_compares(tmp_path: Path, fake_bin: Path) -> None:
    proc = _sweep(
        tmp_path, fake_bin, "--presets", "zero2 fsdp", "--micro", "4 2", "--gpus", "2", "--name", "abl"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launches = [json.loads(line) for line in (tmp_path / "launches.jsonl").read_text().splitlines()]
    assert [launch[0] for launch in launches] == ["deepspeed", "deepspeed", "torchrun", "torchrun"]
    names = [next(a for a in launch if a.startswith("run_name=")) for launch in launches]
    assert names == ["run_name=zero2-m4", "run_name=zero2-m2", "run_name=fsdp-m4", "run_name=fsdp-m2"]
    for launch in launches:
        assert "logging.wandb.group=abl" in launch and "2" in launch
    assert "distributed.strategy=fsdp" in launches[2]
    assert "batch.micro_batch_size=2" in launches[1]
    # Then one comparison over all four runs.
    assert "Config: what differs" in proc.stdout and "fsdp-m2" in proc.stdout
    assert (tmp_path / "runs" / "abl" / "compare" / "loss_vs_step.png").is_file()


@pytest.mark.slow
def test_a_failed_run_is_reported_after_comparing_the_rest(tmp_path: Path, fake_bin: Path) -> None:
    proc = _sweep(tmp_path, fake_bin, "--presets", "zero2 zero3", "--micro", "1", "--name", "f")
    assert proc.returncode == 1
    assert "zero3-m1 FAILED" in proc.stderr and "1 run(s) failed: zero3-m1" in proc.stderr
    assert "zero2-m1" in proc.stdout  # the finished run was still compared


def test_reused_sweep_name_is_refused(tmp_path: Path, fake_bin: Path) -> None:
    (tmp_path / "runs" / "again").mkdir(parents=True)
    proc = _sweep(tmp_path, fake_bin, "--name", "again")
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert not (tmp_path / "launches.jsonl").exists()


def test_unknown_preset_stops_before_any_launch(tmp_path: Path, fake_bin: Path) -> None:
    proc = _sweep(tmp_path, fake_bin, "--presets", "zero9", "--name", "bad")
    assert proc.returncode == 2 and "not a known preset" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "launches.jsonl").exists()
