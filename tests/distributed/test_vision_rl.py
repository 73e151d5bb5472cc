"""Online RL and preference tuning on a vision-language model: one curve whatever the split and the engine.

tiny-qwen2-vl in fp32, the bundled demo images (of different sizes, so the rows' image tokens and M-RoPE
grids differ), 3 steps. GRPO: full fine-tuning, image prompts in TRL's layout, 2 prompts x G 4 = 8
completions per step of at most 4 tokens, `rl.num_iterations: 2`, the user's own reward function (a module on
PYTHONPATH), 3 prompts held out (`data.eval_split`) and answered after the last step (`eval/reward`). DPO:
LoRA on the language model and the projector in full (the reference: the adapters off), image preference
pairs in TRL's layout (`images`, `prompt`, `chosen`, `rejected`), 4 pairs per step, 3 pairs held out; the
GRPO ZeRO-2 run under torchrun, the others `warm` (tests/warm_launch.py):

    launch       launcher   engine              split (micro x accum x dp)   what
    single       api        one process         8 x 1 x 1                   GRPO's reference curve
    zero2        torchrun   DeepSpeed ZeRO-2    2 x 2 x 2                   a group's completions on both ranks
    fsdp         warm       FSDP2               1 x 4 x 2                   the vision blocks and layers sharded
    dpo-single   api        one process         4 x 1 x 1                   DPO's reference curve
    dpo-fsdp     warm       FSDP2               1 x 2 x 2                   a pair's two rows hold its images

Each GRPO rank samples its own completions of its prompts' images (seeded per completion; the prefill runs
the vision tower on the row's images, the decoding steps continue the M-RoPE grid) and the advantages come
from whole groups: the per-step loss, grad norm, reward, completion lengths and the held-out reward agree
within 2e-5; DPO's loss, reward accuracy and margin, and its eval/loss, agree within 2e-5.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from launch_helpers import REPO, Launch, RunResult, max_difference, metric_rows, run_launches, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, TOL = 3, 2e-5
MODULE = "zerofit_launch_vision_rewards"
CURVES = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy", "clip_ratio")
LAUNCHES = [
    Launch("single", "api", ("distributed.strategy=single", "batch.micro_batch_size=8")),
    Launch(
        "zero2",
        "torchrun",
        ("distributed.strategy=deepspeed", "distributed.preset=zero2", "batch.micro_batch_size=2"),
    ),
    Launch("fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
]
DPO_LAUNCHES = [
    Launch("dpo-single", "api", ("distributed.strategy=single", "batch.micro_batch_size=4")),
    Launch("dpo-fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
]
DPO_CURVES = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins")


def _records(images: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(image prompts, image preference pairs) over the demo images, two questions each."""
    names = [image.stem for image in images]
    prompts, pairs = [], []
    for question in ("What colour is this image?", "Name the colour:"):
        for image in images:
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            prompts.append({"prompt": prompt, "image": str(image), "answer": image.stem})
            wrong = names[(names.index(image.stem) + 1) % len(names)]
            chosen, rejected = ([{"role": "assistant", "content": c}] for c in (image.stem, wrong))
            pairs.append({"images": [str(image)], "prompt": prompt, "chosen": chosen, "rejected": rejected})
    return prompts, pairs


def _common(data: Path) -> dict[str, Any]:
    return {
        "seed": 3,
        "model": {"name_or_path": "tiny-qwen2-vl"},
        "optimizer": {"lr": 3e-3},
        "scheduler": {"name": "constant"},
        "data": {"path": str(data), "max_seq_len": 128, "max_image_tokens": 16, "eval_split": 0.25},
        "checkpoint": {"every_minutes": 0},
        "logging": {"console": False, "wandb": {"mode": "disabled"}},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("vision-rl")
    (root / f"{MODULE}.py").write_text(
        "def letters(prompts, completions, columns):\n"
        "    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]\n"
    )
    prompts, pairs = _records(sorted((REPO / "data" / "demo-vlm").glob("*.png")))
    for name, records in (("prompts", prompts), ("pairs", pairs)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    grpo = {
        **_common(root / "prompts.jsonl"),
        "train": {"objective": "grpo", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
        "lora": {"enabled": False},
        "rl": {
            "num_generations": 4,
            "prompts_per_step": 2,
            "max_prompt_length": 128,
            "max_completion_length": 4,
            "num_iterations": 2,
            "rewards": [{"function": f"{MODULE}:letters"}],
        },
    }
    dpo = {
        **_common(root / "pairs.jsonl"),
        "train": {"objective": "dpo", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
        "batch": {"global_batch_size": 4},
        "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0, "projector": "full"},
    }
    dpo_file = write_config(root / "vision-dpo.yaml", dpo)
    launches = [*LAUNCHES, *(dataclasses.replace(launch, config=dpo_file) for launch in DPO_LAUNCHES)]
    env = {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    results = run_launches(launches, write_config(root / "vision-grpo.yaml", grpo), root / "runs", env=env)
    return {name: result.check() for name, result in results.items()}


@pytest.mark.parametrize("name", ["zero2", "fsdp"])
def test_vision_grpo_on_two_ranks_gives_the_one_process_curve(runs: dict[str, RunResult], name: str) -> None:
    run, base = runs[name], runs["single"]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    a, b = metric_rows(run, CURVES), metric_rows(base, CURVES)
    gap = max_difference(a, b)
    assert gap < TOL, (a, b)
    assert run.series("tokens") == base.series("tokens")
    assert abs(base.metrics[-1]["grad_norm"]) > 0  # the curves compared are of real updates
    held = [(r.metrics[-1]["eval/reward"], r.metrics[-1]["eval/prompts"]) for r in (run, base)]
    assert held[0][1] == held[1][1] == 3 and held[0][0] == pytest.approx(held[1][0], abs=TOL)


def test_vision_dpo_on_two_ranks_gives_the_one_process_curve(runs: dict[str, RunResult]) -> None:
    """Each pair's two rows carry its images through collation, the reference (adapters off) and the
    held-out evaluation: FSDP2 over 2 ranks gives the one-process curve and eval/loss."""
    run, base = runs["dpo-fsdp"], runs["dpo-single"]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    for key in DPO_CURVES:
        assert run.series(key) == pytest.approx(base.series(key), abs=TOL), key
    assert abs(base.metrics[-1]["rewards/margins"]) > 0  # the policy moved away from its reference
    assert run.metrics[-1]["eval/loss"] == pytest.approx(base.metrics[-1]["eval/loss"], abs=TOL)
    assert run.metrics[-1]["eval/pairs"] == base.metrics[-1]["eval/pairs"] == 3
