"""CPO with one global batch, any split: one loss curve on one process at 8 x 1 and 2 x 4 and on DeepSpeed
ZeRO-2 over 2 gloo ranks (2 x 2 x 2, through torchrun and the real launcher).

A tiny Llama in fp32, full fine-tuning (CPO has no reference model), preference pairs whose prompt and
response lengths vary a lot, global batch 8 pairs. CPO's two normalizers (the global batch's chosen response
tokens for its NLL, its pairs for the preference term) are all-reduced before any backward, so every split
trains the same steps: per-step loss and rewards/* agree within 2e-5 (fp32 reductions in another order).

    launch        launcher   engine              split (micro x accum x dp)
    one-8x1       api        one process         8 x 1 x 1   (the reference)
    one-2x4       api        one process         2 x 4 x 1
    zero2-2x2x2   torchrun   DeepSpeed ZeRO-2    2 x 2 x 2
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
from zerofit.objectives.pairwise.loss import METRICS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

N_PAIRS, GLOBAL, STEPS, SEED, LR, MAX_LEN, TOL = 24, 8, 4, 5, 2e-3, 64, 2e-5
CURVES = ("loss", *(m for m in METRICS if m != "rewards/accuracies"))
LAUNCHES = [
    Launch("one-8x1", "api", ("distributed.strategy=single", "batch.micro_batch_size=8")),
    Launch("one-2x4", "api", ("distributed.strategy=single", "batch.micro_batch_size=2")),
    Launch("zero2-2x2x2", "torchrun", ("distributed.preset=zero2", "batch.micro_batch_size=2")),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("cpo")
    config = write_config(
        root / "cpo.yaml",
        {
            "seed": SEED,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": GLOBAL},
            "distributed": {"strategy": "deepspeed"},
            "train": {"objective": "cpo", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": LR},
            "scheduler": {"name": "cosine", "warmup_steps": 1},
            "lora": {"enabled": False},
            "preference": {"beta": 0.5, "cpo_alpha": 0.5},
            "data": {
                "path": str(preference_pairs_file(root / "train.jsonl", N_PAIRS, 0)),
                "max_seq_len": MAX_LEN,
            },
            "checkpoint": {"every_minutes": 0},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    results = run_launches(LAUNCHES, config, root / "runs")
    for result in results.values():
        result.check()
    return results


@pytest.mark.parametrize("name", ["one-2x4", "zero2-2x2x2"])
def test_one_cpo_curve_for_every_split_and_engine(runs: dict[str, RunResult], name: str) -> None:
    run, base = runs[name], runs["one-8x1"]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    assert max_difference(metric_rows(run, CURVES), metric_rows(base, CURVES)) < TOL
    assert run.series("tokens") == base.series("tokens")


def test_the_splits_are_the_ones_asked_and_training_moved(runs: dict[str, RunResult]) -> None:
    split = {
        r: (runs[r].metrics[-1]["micro_batch_size"], runs[r].metrics[-1]["grad_accum_steps"]) for r in runs
    }
    assert split == {"one-8x1": (8, 1), "one-2x4": (2, 4), "zero2-2x2x2": (2, 2)}
    assert "objective    cpo (sigmoid, beta 0.5" in runs["zero2-2x2x2"].stdout
    losses = runs["one-8x1"].series("loss")
    assert max(losses) - min(losses) > 0.1  # training moved the model: the curves compared above are not flat
