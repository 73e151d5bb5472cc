"""KTO with one global batch, any split: one loss curve on one process and on 2 ranks.

A tiny Llama in fp32 with LoRA (KTO's reference: the adapters off), unpaired examples whose prompt and
completion lengths vary a lot and whose labels are mixed, global batch 8, held-out examples evaluated every
2 steps; the packed run `warm` (tests/warm_launch.py), ZeRO-2 under torchrun:

    launch    launcher   engine              split (micro x accum x dp)
    single    api        one process         8 x 1 x 1      (W&B offline; `zerofit.train`, in the test process)
    zero2     torchrun   DeepSpeed ZeRO-2    2 x 2 x 2
    packed    warm       DeepSpeed ZeRO-2    2 rows of 64 tokens x dp 2 (`batch.tokens_per_micro_batch`:
                                             examples and their mismatched sequences as segments of rows)

Per-step loss, TRL's metrics (rewards/*, logps/*, kl) and eval/* agree within 2e-5: the mismatched pairing,
the KL reference point z0 and the normalizers are the global batch's (`zerofit.objectives.kto.loss`). The split
within one process (8 x 1 against 2 x 4) is tests/unit/objectives/test_kto.py's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from launch_helpers import Launch, RunResult, run_launches, write_config
from zerofit.objectives.kto.loss import KTO_METRICS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

N_TRAIN, N_EVAL, GLOBAL, STEPS, SEED, LR, MAX_LEN, TOL = 24, 6, 8, 4, 5, 5e-3, 64, 2e-5
LAUNCHES = [
    Launch(
        "single",
        "api",
        ("distributed.strategy=single", "batch.micro_batch_size=8", "logging.wandb.mode=offline"),
    ),
    Launch("zero2", "torchrun", ("distributed.preset=zero2", "batch.micro_batch_size=2")),
    Launch(
        "packed",
        "warm",
        ("distributed.preset=zero2", "batch.micro_batch_size=null", f"batch.tokens_per_micro_batch={2 * 64}"),
    ),
]


def _unpaired(path: Path, n: int, seed: int) -> Path:
    """Records with prompts of 1..40 and completions of 1..50 characters, labels mixed (digits desirable)."""
    rng = random.Random(seed)

    def text(alphabet: str) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 3, 8, 25, 50])))

    with path.open("w") as f:
        for i in range(n):
            good = i % 3 != 0
            record = {
                "prompt": text("abcdefgh")[:40],
                "completion": text("0123456789" if good else "xyz!?"),
                "label": good,
            }
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("kto")
    config = write_config(
        root / "kto.yaml",
        {
            "seed": SEED,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": GLOBAL},
            "distributed": {"strategy": "deepspeed"},
            "train": {"objective": "kto", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": LR},
            "scheduler": {"name": "constant"},
            "lora": {"enabled": True, "dropout": 0.0, "target_modules": "all-linear"},
            "kto": {"beta": 0.5, "undesirable_weight": 1.5},
            "data": {
                "path": str(_unpaired(root / "train.jsonl", N_TRAIN, 0)),
                "eval_path": str(_unpaired(root / "eval.jsonl", N_EVAL, 1)),
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


def _curve(result: RunResult, keys: list[str]) -> list[list[float]]:
    return [[row[k] for k in keys if k in row] for row in result.metrics]


def test_two_ranks_give_the_one_process_curve(runs: dict[str, RunResult]) -> None:
    single, zero2 = runs["single"], runs["zero2"]
    assert [row["step"] for row in zero2.metrics] == list(range(1, STEPS + 1))
    assert [(r["micro_batch_size"], r["grad_accum_steps"], r["dp_size"]) for r in zero2.metrics[-1:]] == [
        (2, 2, 2)
    ]
    keys = ["loss", *KTO_METRICS, *(f"eval/{k}" for k in ("loss", *KTO_METRICS))]
    a, b = _curve(single, keys), _curve(zero2, keys)
    assert [len(r) for r in a] == [len(r) for r in b]
    assert max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)) < TOL
    assert (
        max(single.series("kl")) > 0 or max(r.get("eval/kl", 0) for r in single.metrics) > 0
    )  # z0 not all clamped
    assert single.metrics[0]["loss"] != pytest.approx(single.metrics[-1]["loss"], abs=1e-3)  # it learned


def test_packed_examples_on_2_ranks_give_the_padded_one_process_curve(runs: dict[str, RunResult]) -> None:
    """The loss within 1e-6; the metrics, sums of log-probs of up to a hundred nats (fp32 spacing 8e-6) and
    z0, within 1e-4 (the segments' per-token log-probs round differently from the padded rows')."""
    single, packed = runs["single"], runs["packed"]
    assert "token budget 128 per micro-batch" in packed.stdout
    keys = ["loss", *KTO_METRICS, *(f"eval/{k}" for k in ("loss", *KTO_METRICS))]
    a, b = _curve(single, keys), _curve(packed, keys)
    assert [len(r) for r in a] == [len(r) for r in b]
    assert max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)) < 1e-4
    assert max(abs(x - y) for x, y in zip(single.series("loss"), packed.series("loss"), strict=True)) < 1e-6


def test_metrics_carry_trl_names_in_metrics_jsonl_and_wandb(runs: dict[str, RunResult]) -> None:
    from zerofit.metrics.wandb_reader import read_wandb_run

    single = runs["single"]
    for row in single.metrics:
        assert {"rewards/chosen", "logps/chosen", "kl"} <= set(row)
    assert set(KTO_METRICS) <= set(single.metrics[-1])
    assert {"eval/loss", "eval/kl", "eval/rewards/margins", "eval/examples"} <= set(single.metrics[-1])
    (run_file,) = (single.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = read_wandb_run(run_file).history
    last = history[max(history)]
    for name in (*KTO_METRICS, "loss", "eval/loss", "eval/kl"):
        assert last[name] == pytest.approx(single.metrics[-1][name], rel=1e-6), name
