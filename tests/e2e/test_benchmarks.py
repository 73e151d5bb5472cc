"""Every script in benchmarks/ runs as a user runs it, at its smallest size, so none can rot unnoticed.

Each is started as a subprocess from the repository root (CPU, tiny-llama, one or two timed steps) and must
exit 0 and print or write its result: the ratios it exists to report, its JSON. Nothing here looks at the
numbers themselves (tests never assert on time). `workloads.py` is the module they share: it feeds
zerofit's real training loop (`assemble` + `train_loop`), which is what broke when the loop's
checkpointer protocol gained an argument.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # One thread per process: the suite shares a small CPU, and these measure nothing here.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_cpu_vs_hf_prints_and_writes_its_ratios(tmp_path: Path) -> None:
    out = tmp_path / "cpu_vs_hf.json"
    small = ("--steps", "1", "--repeats", "1", "--seq", "32", "--global-batch", "4", "--hf-micro", "2")
    result = _run(str(BENCH / "cpu_vs_hf.py"), *small, "--json", str(out))
    assert (
        "zf-auto / hf (max-length): " in result.stdout and "x (useful tokens per CPU second)" in result.stdout
    )
    report = json.loads(out.read_text())
    assert set(report["median"]) == {
        "zf-same",
        "zf-full",
        "zf-auto",
        "zf-packed",
        "zf-auto-real",
        "hf",
        "hf-real",
    }
    assert all(value > 0 for value in report["ratios_useful_tokens_per_cpu_s"].values())


def test_gpu_fit_smoke_runs_a_zerofit_case_and_writes_its_results(tmp_path: Path) -> None:
    result = _run(
        str(BENCH / "gpu_fit.py"),
        "--smoke",
        "--cases",
        "lora-auto",
        "--steps",
        "1",
        "--results",
        str(tmp_path),
    )
    (path,) = tmp_path.glob("gpu_fit-smoke-*.json")
    assert f"wrote {path}" in result.stdout
    (case,) = json.loads(path.read_text())["results"]
    assert case["case"] == "lora-auto" and case["ok"] is True, case
    assert case["useful_tokens_per_s"] > 0 and case["predicted"]["verdict"]


def test_hf_baseline_prints_its_result_line(tmp_path: Path) -> None:
    from zerofit.tiny_llama import ensure_tiny_llama

    out = tmp_path / "hf.jsonl"
    model = str(ensure_tiny_llama(0))
    small = ("--micro", "1", "--gas", "2", "--seq", "32", "--steps", "1", "--precision", "fp32")
    result = _run(str(BENCH / "hf_baseline.py"), "--model-dir", model, *small, "--out", str(out))
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("HF_BASELINE ")]
    printed = json.loads(line.removeprefix("HF_BASELINE "))
    assert printed["ok"] is True and printed["useful_tokens_per_s"] > 0
    assert json.loads(out.read_text()) == printed


def test_overhead_vs_torch_prints_its_ratio_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    small = ("--steps", "1", "--warmup", "0", "--repeats", "1", "--micro", "2", "--global-batch", "4")
    result = _run(str(BENCH / "overhead_vs_torch.py"), *small, "data.max_seq_len=32", "--json", str(out))
    assert "ratio zerofit / reference (median step time): " in result.stdout
    report = json.loads(out.read_text())
    assert report["ratio_median_step"] > 0


def test_loss_memory_prints_every_loss_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "loss_memory.json"
    result = _run(str(BENCH / "loss_memory.py"), "--smoke", "--json", str(out))
    assert "fused_linear / chunked: peak " in result.stdout
    report = json.loads(out.read_text())
    assert [r["impl"] for r in report["results"]] == ["unchunked", "chunked", "fused_linear"]
    sums = [r["loss_sum"] for r in report["results"]]
    assert max(sums) - min(sums) <= 1e-5 * max(sums)  # the same token sums
    assert all(r["peak_mib"] > 0 for r in report["results"])
