"""Ulysses sequence parallelism through the real launchers: one global batch, the same training.

A tiny Llama (4 attention heads, 2 key/value heads), full fine-tuning in fp32, ragged data (1 to ~60
tokens), global batch 8, the first sequence-parallel run under torchrun and the others `warm` (tests/warm_launch.py), as

    launch       launcher   what
    single       api        one process, micro 8 (the reference: the Python API, in the test process)
    sp2          torchrun   DeepSpeed ZeRO-3 on 2 ranks, distributed.sequence_parallel=2, micro 4 x accum 2
                            x dp 1, every layer checkpointed
    sp2-m8       warm       the same split as (SP 2, dp 1) with the whole global batch in one micro-batch:
                            micro 8 x accum 1, no layer checkpointed, no checkpoint saved (started beside
                            the resumed run below, which waits for sp2's)
    sp2-to-dp2   warm       sp2's step-2 checkpoint resumed without sequence parallelism: micro 2 x accum 2
                            x dp 2

Every sequence of the SP run is sharded over both ranks, attention through DeepSpeed's all-to-all
(`UlyssesSPAttentionHF`), labels shifted before the cut; the loss curve, the token counts, the pre-clip
grad norms, the evaluation loss (every 2 steps, 20% held out) and the exported weights agree with one
process within 2e-5, and so do the steps trained after resuming on another sequence-parallel size and dp.
No launch starts under the `deepspeed` runner (DeepSpeed runs under either launcher; the `deepspeed`
runner's own start-up is what test_engines and test_stop_resume exercise).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from launch_helpers import (
    Launch,
    RunResult,
    copy_as_interrupted,
    run_launches,
    varied_length_data,
    write_config,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, TOL = 4, 2e-5
# ZeRO-3 (its reduce-scatter divides by the world, not dp: `render._deepspeed_divide_factor`), every layer
# checkpointed (the recomputation runs the all-to-alls again).
SP2 = (
    "distributed.preset=zero3",
    "distributed.sequence_parallel=2",
    "batch.micro_batch_size=4",
    "train.activation_checkpointing=true",
)
RESUMED = ("distributed.preset=zero3", "batch.micro_batch_size=2", "checkpoint.resume=true")
SP2_MICRO8 = (*SP2[:2], "batch.micro_batch_size=8", "checkpoint.every_steps=0", "checkpoint.save_final=false")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunResult]]:
    root = tmp_path_factory.mktemp("sequence-parallel")
    data = varied_length_data(root / "varied.jsonl", 25)
    config = write_config(
        root / "sp.yaml",
        {
            "seed": 7,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 8},
            "distributed": {"strategy": "deepspeed"},
            "train": {"max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": 1e-3},
            "scheduler": {"name": "cosine", "warmup_steps": 1},
            "lora": {"enabled": False},
            "data": {"path": str(data), "max_seq_len": 64, "eval_split": 0.2},
            "eval": {"every_steps": 2},
            "checkpoint": {"every_steps": 2},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    out = root / "runs"
    single = Launch("single", "api", ("distributed.strategy=single", "batch.micro_batch_size=8"))
    results = run_launches([single, Launch("sp2", "torchrun", SP2)], config, out)
    copy_as_interrupted(results["sp2"].check().run_dir, out / "sp2-to-dp2", stopped_at=2, last_step=STEPS)
    second = [Launch("sp2-to-dp2", "warm", RESUMED), Launch("sp2-m8", "warm", SP2_MICRO8)]
    results.update(run_launches(second, config, out))
    for result in results.values():
        result.check()
    yield results
    shutil.rmtree(root, ignore_errors=True)


def _close(a: list[float], b: list[float]) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < TOL


def test_sp2_trains_one_global_batch_like_one_process(runs: dict[str, RunResult]) -> None:
    ref, sp = runs["single"], runs["sp2"]
    assert [(r["micro_batch_size"], r["grad_accum_steps"], r["dp_size"]) for r in sp.metrics] == [
        (4, 2, 1)
    ] * 4
    assert sp.series("tokens") == ref.series("tokens")  # every valid label counted once per group
    assert _close(sp.series("loss"), ref.series("loss")), (sp.series("loss"), ref.series("loss"))
    assert _close(sp.series("grad_norm"), ref.series("grad_norm"))
    assert "sequence parallel 2: each sequence sharded over 2 ranks" in sp.stdout


def test_sp2_in_one_micro_batch_trains_like_one_process(runs: dict[str, RunResult]) -> None:
    ref, sp = runs["single"], runs["sp2-m8"]
    assert [(r["micro_batch_size"], r["grad_accum_steps"], r["dp_size"]) for r in sp.metrics] == [
        (8, 1, 1)
    ] * 4
    assert sp.series("tokens") == ref.series("tokens")
    assert _close(sp.series("loss"), ref.series("loss")), (sp.series("loss"), ref.series("loss"))
    assert _close(sp.series("grad_norm"), ref.series("grad_norm"))
    evals = [(r["eval/loss"], r["eval/tokens"]) for r in sp.metrics if "eval/loss" in r]
    ref_evals = [(r["eval/loss"], r["eval/tokens"]) for r in ref.metrics if "eval/loss" in r]
    assert [t for _, t in evals] == [t for _, t in ref_evals]
    assert _close([loss for loss, _ in evals], [loss for loss, _ in ref_evals])


def test_sp2_evaluation_loss_is_exact(runs: dict[str, RunResult]) -> None:
    ref = [(r["eval/loss"], r["eval/tokens"]) for r in runs["single"].metrics if "eval/loss" in r]
    sp = [(r["eval/loss"], r["eval/tokens"]) for r in runs["sp2"].metrics if "eval/loss" in r]
    assert len(sp) == len(ref) == 2 and [t for _, t in sp] == [t for _, t in ref]
    assert _close([loss for loss, _ in sp], [loss for loss, _ in ref]), (sp, ref)


def test_sp2_exports_the_one_process_weights(runs: dict[str, RunResult]) -> None:
    ref, sp = runs["single"].exported(), runs["sp2"].exported()
    assert set(sp) == set(ref)
    assert max(float((sp[k] - ref[k]).abs().max()) for k in ref) < TOL


def test_resume_on_another_sequence_parallel_size_and_dp(runs: dict[str, RunResult]) -> None:
    ref, resumed = runs["single"], runs["sp2-to-dp2"]
    assert [r["step"] for r in resumed.metrics] == list(range(1, STEPS + 1))  # steps 1-2 kept, 3-4 trained
    assert [r["dp_size"] for r in resumed.metrics[2:]] == [2, 2]
    assert _close(resumed.series("loss"), ref.series("loss")), (resumed.series("loss"), ref.series("loss"))
    assert max(float((resumed.exported()[k] - v).abs().max()) for k, v in ref.exported().items()) < TOL
