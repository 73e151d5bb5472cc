"""A reward model (`train.objective: reward`) with one global batch, any split, any engine: one loss curve.

The built-in tiny Llama as a one-output sequence classifier, LoRA with the score head trained in full, fp32,
pairs whose prompt and response lengths vary a lot (a margin column on some), global batch 8 pairs,
held-out pairs evaluated every 2 steps, ZeRO-2 on the real launcher (gloo), the packed FSDP2 run `warm` (tests/warm_launch.py) and, for the reference, the Python API:

    launch   launcher   engine                 split (micro x accum x dp)
    single   api        one process            8 x 1 x 1     (`zerofit.train`, in the test process)
    zero2    torchrun   DeepSpeed ZeRO-2       2 x 2 x 2
    fsdp     warm       FSDP2, packed          2 rows of 64 tokens x 2 x 2 (`batch.tokens_per_micro_batch`: each
                                               sequence a segment of a row, scored at its last token)

Per-step loss, rewards/* and eval/* agree within 2e-5 (the packed run's loss within 1e-6); the metrics are in metrics.jsonl and the offline W&B
run. (The split-exactness in one process, 8 x 1 vs 2 x 4, and the per-micro-batch mean that disagrees are
tests/unit/objectives/test_reward.py's.)
"""

from __future__ import annotations

import pytest

from launch_helpers import (
    Launch,
    RunResult,
    max_difference,
    metric_rows,
    preference_pairs_file,
    run_launches,
    write_config,
)
from zerofit.objectives.reward_model.loss import REWARD_METRICS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

N_PAIRS, N_EVAL, GLOBAL, STEPS, SEED, LR, MAX_LEN, TOL = 24, 6, 8, 4, 5, 5e-3, 64, 2e-5
LAUNCHES = [
    Launch(
        "single",
        "api",
        ("distributed.strategy=single", "batch.micro_batch_size=8", "logging.wandb.mode=offline"),
    ),
    Launch("zero2", "torchrun", ("distributed.preset=zero2", "batch.micro_batch_size=2")),
    Launch(
        "fsdp",
        "warm",
        (
            "distributed.strategy=fsdp",
            "batch.micro_batch_size=null",
            f"batch.tokens_per_micro_batch={2 * 64}",
        ),
    ),
]
# rewards/accuracies counts pairs whose chosen reward is above the rejected one: a count, equal run to run
# unless a pair's two rewards are within rounding of each other; the means below carry the same facts.
CURVES = ("loss", *(m for m in REWARD_METRICS if m != "rewards/accuracies"))
EVAL_CURVES = ("eval/loss", *(f"eval/{m}" for m in REWARD_METRICS if m != "rewards/accuracies"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("reward")
    config = write_config(
        root / "reward.yaml",
        {
            "seed": SEED,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": GLOBAL},
            "distributed": {"strategy": "deepspeed"},
            "train": {"objective": "reward", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": LR},
            "scheduler": {"name": "cosine", "warmup_steps": 1},
            "lora": {"enabled": True, "dropout": 0.0, "target_modules": "all-linear"},
            "reward": {"center_rewards_coefficient": 0.01},
            "data": {
                "path": str(preference_pairs_file(root / "train.jsonl", N_PAIRS, 0, margin_every=3)),
                "eval_path": str(preference_pairs_file(root / "eval.jsonl", N_EVAL, 1, margin_every=3)),
                "max_seq_len": MAX_LEN,
            },
            "eval": {"every_steps": 2},
            "checkpoint": {"every_minutes": 0},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    results = run_launches(LAUNCHES, config, root / "runs")
    for result in results.values():
        result.check()
    return results


@pytest.mark.parametrize("name", ["zero2", "fsdp"])
def test_one_reward_curve_for_every_engine_and_split(runs: dict[str, RunResult], name: str) -> None:
    run, base = runs[name], runs["single"]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    assert (run.metrics[-1]["micro_batch_size"], run.metrics[-1]["dp_size"]) == (
        2,
        2,
    )
    assert max_difference(metric_rows(run, CURVES), metric_rows(base, CURVES)) < TOL
    assert max_difference(metric_rows(run, EVAL_CURVES), metric_rows(base, EVAL_CURVES)) < TOL
    assert [row["eval/pairs"] for row in run.metrics if "eval/pairs" in row] == [N_EVAL, N_EVAL]
    assert base.metrics[0]["loss"] - base.metrics[-1]["loss"] > 1e-3  # it trained: the curves are not flat
    if name == "fsdp":  # packed
        assert max_difference(metric_rows(run, ("loss",)), metric_rows(base, ("loss",))) < 1e-6


def test_metrics_in_metrics_jsonl_and_wandb(runs: dict[str, RunResult]) -> None:
    from zerofit.metrics.wandb_reader import read_wandb_run

    single = runs["single"]
    for row in single.metrics:
        assert set(REWARD_METRICS) <= set(row) and 0 <= row["rewards/accuracies"] <= 1
    (run_file,) = (single.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = read_wandb_run(run_file).history
    last = history[max(history)]
    for name in (*REWARD_METRICS, "loss", "eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"):
        assert last[name] == pytest.approx(single.metrics[-1][name], rel=1e-6), name
