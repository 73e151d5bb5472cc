"""Every engine trains in half precision, writes the run directory of docs/contracts.md, and resumes exactly.

Real launches (2 gloo ranks): ZeRO-2 under the `deepspeed` runner, FSDP2 under `torchrun`; the other
engines' launches and ZeRO-2's resume `warm` (tests/warm_launch.py), each launcher's own behaviour being
covered by those (resumes through the real launchers: test_stop_resume's chains); the one-process runs through the Python API in the test process
(`zerofit.train`, launcher `api`: the `python` launcher's own behaviour is test_stop_resume's and
test_launch_errors'), LoRA with dropout, a small data set seen repeatedly so the loss must fall:

- bf16 on single, DeepSpeed ZeRO-2, FSDP2 and DDP completes and the loss falls;
- fp16 with loss scaling completes on single; on DeepSpeed it completes where DeepSpeed's accelerator
  supports fp16, and otherwise is refused up front with a clear message (exit 2, no traceback);
- run directory: fully resolved config.yaml, the engine config exactly as rendered, metrics.jsonl with
  every field docs/contracts.md lists for it, checkpoints/, adapter/;
- resume: 6 uninterrupted steps == 3 steps + resume from the step-3 checkpoint to 6 (single, DeepSpeed).

    launch               launcher    engine                          precision
    bf16-single          api         one process                     bf16
    bf16-zero2           deepspeed   DeepSpeed ZeRO-2                bf16
    bf16-fsdp            torchrun    FSDP2                           bf16
    bf16-ddp             warm        DDP                             bf16
    bf16-zero3-offload   warm        DeepSpeed ZeRO-3, CPU offload   bf16
    bf16-fsdp-offload    warm        FSDP2, CPU offload              bf16
    fp16-single          api         one process                     fp16, loss scaling
    fp16-zero2           warm        DeepSpeed ZeRO-2                fp16 (or refused up front)
    resume-single        api         one process                     bf16, resumed from bf16-single's step 3
    resume-zero2         warm        DeepSpeed ZeRO-2                bf16, resumed from bf16-zero2's step 3
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launch_helpers import (
    Launch,
    RunResult,
    deepspeed_shm_segments,
    run_and_resume,
    varied_length_data,
    write_config,
)
from zerofit.config import load_config
from zerofit.engine_spec import render_spec
from zerofit.resolution import resolve

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, EVERY = 6, 3
# The fields every metrics.jsonl row carries on one rank (docs/contracts.md, metrics.jsonl).
METRICS_FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "micro_batch_size",
    "grad_accum_steps",
    "dp_size",
    "mem/source",
    "mem/rank0/allocated_gib",
    "mem/rank0/reserved_gib",
    "mem/rank0/peak_gib",
}
HALF = [
    Launch("bf16-single", "api", ("distributed.strategy=single", "train.precision=bf16")),
    Launch("bf16-zero2", "deepspeed", ("distributed.preset=zero2", "train.precision=bf16")),
    Launch("bf16-fsdp", "torchrun", ("distributed.strategy=fsdp", "train.precision=bf16")),
    Launch("bf16-ddp", "warm", ("distributed.strategy=ddp", "train.precision=bf16")),
    # The offload presets: DeepSpeed's own CPU Adam steps offloaded state (ZeRO-3 also offloads params);
    # FSDP2's CPUOffloadPolicy keeps sharded params, grads and the optimizer step on the host.
    Launch("bf16-zero3-offload", "warm", ("distributed.preset=zero3_offload", "train.precision=bf16")),
    Launch(
        "bf16-fsdp-offload",
        "warm",
        ("distributed.strategy=fsdp", "distributed.preset=fsdp_offload", "train.precision=bf16"),
    ),
    Launch("fp16-single", "api", ("distributed.strategy=single", "train.precision=fp16")),
    Launch("fp16-zero2", "warm", ("distributed.preset=zero2", "train.precision=fp16")),
]
RESUMED = {"bf16-single": "resume-single", "bf16-zero2": "resume-zero2"}


def _deepspeed_supports_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engines")
    data = varied_length_data(root / "eight.jsonl", 8, seed=3)
    return write_config(
        root / "engines.yaml",
        {
            "seed": 11,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "distributed": {"strategy": "deepspeed"},
            "train": {"max_steps": STEPS},
            "optimizer": {"lr": 1e-2},
            "scheduler": {"name": "constant"},
            # Dropout on: an exact resume must restore the RNG stream too.
            "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.1},
            "data": {"path": str(data), "max_seq_len": 64},
            "checkpoint": {"every_steps": EVERY, "keep_last": 2},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )


@pytest.fixture(scope="module")
def runs(config: Path, shm_before: set[Path]) -> dict[str, RunResult]:
    warm = {"resume-zero2": "warm"}
    return run_and_resume(HALF, config, config.parent / "runs", RESUMED, EVERY, STEPS, launchers=warm)


def test_deepspeed_cpu_launches_leave_no_shared_memory_behind(
    runs: dict[str, RunResult], shm_before: set[Path]
) -> None:
    # DeepSpeed's CPU allreduce never unlinks its per-rank /dev/shm segments (66 MB each); zerofit removes
    # the names once every rank has mapped them, so the launches above (ZeRO-2, ZeRO-3 offload, fp16, the
    # resumes) leave none behind.
    assert runs["bf16-zero2"].check() and runs["bf16-zero3-offload"].check()
    assert sorted(deepspeed_shm_segments() - shm_before) == []


@pytest.mark.parametrize(
    "name",
    [
        "bf16-single",
        "bf16-zero2",
        "bf16-fsdp",
        "bf16-ddp",
        "bf16-zero3-offload",
        "bf16-fsdp-offload",
        "fp16-single",
    ],
)
def test_half_precision_trains_and_loss_falls(runs: dict[str, RunResult], name: str) -> None:
    losses = runs[name].check().series("loss")
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.2, losses


def test_fp16_on_deepspeed_runs_or_is_refused_clearly(runs: dict[str, RunResult]) -> None:
    run = runs["fp16-zero2"]
    if _deepspeed_supports_fp16():
        losses = run.check().series("loss")
        assert losses[-1] < losses[0] - 0.2, losses
        assert not any(run.series("step_skipped")[1:])
    else:  # e.g. a CPU without AVX512-FP16: DeepSpeed refuses fp16; we say so before building anything
        assert run.returncode == 2
        assert "train.precision = 'fp16'" in run.stderr and "train.precision=bf16" in run.stderr
        assert "Traceback" not in run.stderr + run.stdout
        assert not run.run_dir.exists()


@pytest.mark.parametrize("name", ["bf16-single", "bf16-zero2", "bf16-fsdp", "bf16-ddp"])
def test_run_directory_holds_every_file_of_the_layout(runs: dict[str, RunResult], name: str) -> None:
    run = runs[name].check()
    files = {p.name for p in run.run_dir.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "checkpoints", "adapter"} <= files
    text = (run.run_dir / "config.yaml").read_text()
    # The one value the device decides at load (docs/contracts.md): the varlen kernel; every other is concrete.
    assert "auto" not in text.replace("varlen_kernel: auto", "")
    saved = yaml.safe_load(text)
    assert saved["batch"]["grad_accum_steps"] == runs[name].metrics[0]["grad_accum_steps"]
    # The engine file is exactly what the renderer produced for this resolved config.
    cfg = load_config(run.run_dir / "config.yaml")
    dp = run.metrics[0]["dp_size"]
    engine_file = {"deepspeed": "ds_config.json", "fsdp": "fsdp.json"}.get(
        saved["distributed"]["strategy"], "engine.json"
    )
    assert json.loads((run.run_dir / engine_file).read_text()) == render_spec(resolve(cfg, dp)).to_json()
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir()) == [
        f"step-{EVERY}",
        f"step-{STEPS}",
    ]
    assert (run.run_dir / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("name", ["bf16-single", "bf16-zero2", "bf16-fsdp", "bf16-ddp"])
def test_metrics_rows_have_every_documented_field(runs: dict[str, RunResult], name: str) -> None:
    rows = runs[name].check().metrics
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        missing = METRICS_FIELDS - set(row)
        missing |= {f"mem/rank{r}/peak_gib" for r in range(row["dp_size"])} - set(row)
        assert not missing, missing
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["grad_norm"] > 0


def test_plan_printed_once_with_every_factor(runs: dict[str, RunResult]) -> None:
    out = runs["bf16-zero2"].stdout
    assert out.count("zerofit plan") == 1  # rank 0 only
    assert "global 8 = micro 2 x accum 2 x dp 2" in out
    assert "ds_config.json" in out and "trainable" in out and "tokens/step" in out


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_continues_exactly(runs: dict[str, RunResult], name: str) -> None:
    straight, resumed = runs[name].check(), runs[RESUMED[name]].check()
    assert f"checkpoints/step-{EVERY} at step {EVERY} of {STEPS}" in resumed.stdout
    assert [row["step"] for row in resumed.metrics] == list(range(1, STEPS + 1))
    a, b = straight.series("loss"), resumed.series("loss")
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-6, (a, b)
    assert resumed.series("lr") == straight.series("lr")
