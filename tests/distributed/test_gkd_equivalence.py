"""On-policy distillation with one global batch, any split, any engine: one curve.

The tiny Llama in fp32 (full fine-tuning) learns from a teacher folder (the tiny Llama's weights moved by
seeded noise: the same tokenizer, another distribution), 2 prompts x 4 = 8 completions per step of at most 5
tokens, `gkd.lmbda` 0.5 (about half the student's samples, half the data's completions), `gkd.beta` 0.5,
3 steps; the one-process references through the Python API (`zerofit.train`, in the test process), ZeRO-2
through torchrun (gloo), FSDP2 `warm` (tests/warm_launch.py):

    launch    launcher   engine              split (micro x accum x dp)   what
    single    api        one process         8 x 1 x 1                   the reference curve
    accum     api        one process         2 x 4 x 1                   accumulation
    zero2     torchrun   DeepSpeed ZeRO-2    2 x 2 x 2                   2 ranks
    fsdp      warm       FSDP2               1 x 4 x 2                   2 ranks, layers gathered per rollout

Which completions are on-policy, and each sampled completion's tokens, are drawn from (seed, step, completion
index) alone, and the loss is normalized by the global batch's completion tokens (one all-reduced count), so
the per-step loss, grad norm, on-policy fraction and completion lengths agree within 1e-6 (they differ by ~1e-8).
With seed 0, at some step one FSDP2 rank has no completion of the student's to sample and the other has: it
still joins the layers' all-gather (`DistillRollouts._gather_once`), or the run would hang.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch_helpers import Launch, RunResult, max_difference, metric_rows, run_launches, write_config
from zerofit.loop.distill import on_policy

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, TOL, SEED = 3, 1e-6, 0
CURVES = ("loss", "grad_norm", "on_policy_fraction", "completions/mean_length", "tokens")
LAUNCHES = [
    Launch("single", "api", ("distributed.strategy=single", "batch.micro_batch_size=8")),
    Launch("accum", "api", ("distributed.strategy=single", "batch.micro_batch_size=2")),
    Launch(
        "zero2",
        "torchrun",
        ("distributed.strategy=deepspeed", "distributed.preset=zero2", "batch.micro_batch_size=2"),
    ),
    Launch("fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
]


def write_teacher(folder: Path, seed: int = 0, scale: float = 1.0) -> Path:
    """The tiny Llama's folder with every weight moved by seeded noise (`scale` x its std): a teacher of the
    student's tokenizer whose distribution differs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerofit.models.tiny import ensure_tiny_llama

    source = ensure_tiny_llama()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("gkd")
    teacher = write_teacher(root / "teacher")
    data = root / "distill.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"item {i}{'?' * (i % 3)}: ", "completion": f"{i * 7 % 10}"}) + "\n"
            for i in range(12)
        )
    )
    config = write_config(
        root / "gkd.yaml",
        {
            "seed": SEED,
            "model": {"name_or_path": "tiny-llama"},
            "train": {"objective": "gkd", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": 3e-3},
            "scheduler": {"name": "constant"},
            "lora": {"enabled": False},
            "rl": {"num_generations": 4, "prompts_per_step": 2, "max_completion_length": 5},
            "gkd": {"teacher": str(teacher), "lmbda": 0.5, "beta": 0.5},
            "data": {"path": str(data)},
            "checkpoint": {"every_minutes": 0},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    results = run_launches(LAUNCHES, config, root / "runs")
    for result in results.values():
        result.check()
    return results


@pytest.mark.parametrize("name", ["accum", "zero2", "fsdp"])
def test_one_distillation_curve_for_every_engine_and_split(runs: dict[str, RunResult], name: str) -> None:
    run, base = runs[name], runs["single"]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    difference = max_difference(metric_rows(run, CURVES), metric_rows(base, CURVES))
    assert difference < TOL, (metric_rows(run, CURVES), metric_rows(base, CURVES))


def test_the_curve_is_a_real_mix_of_sampled_and_data_completions(runs: dict[str, RunResult]) -> None:
    """lmbda 0.5 gave steps of both kinds of completion, one FSDP2 rank sampled nothing at some step (the
    FSDP2 split gives rank r the completions r, r + 2, ...), and the student learned (the loss is not flat)."""
    coins = [[on_policy(SEED, step, c, 0.5) for c in range(8)] for step in range(STEPS)]
    assert any((sum(c[0::2]) == 0) != (sum(c[1::2]) == 0) for c in coins), coins
    fractions = runs["single"].series("on_policy_fraction")
    assert all(0.0 < f < 1.0 for f in fractions), fractions
    assert min(runs["single"].series("grad_norm")) > 0
    assert runs["single"].series("loss")[0] > 1e-3
