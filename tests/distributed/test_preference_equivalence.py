"""DPO with one global batch, any split, any engine: one loss curve, on training and held-out pairs.

A tiny Llama in fp32, preference pairs whose prompt and response lengths vary a lot, global batch 8 pairs,
held-out pairs evaluated every 2 steps, the one-process runs through the Python API (`zerofit.train`, in the
test process), the interrupted ZeRO-2 run through the real launcher (torchrun; gloo; DeepSpeed under
`torchrun`: the `deepspeed` runner's own start-up is what test_engines and test_stop_resume exercise), the
rest of the matrix `warm` (tests/warm_launch.py):

    launch          launcher   engine                   split (micro x accum x dp)   reference
    single          api        one process              8 x 1 x 1             precomputed (full fine-tuning)
    zero2           torchrun   DeepSpeed ZeRO-2         2 x 2 x 2, SIGTERM mid-run and resumed (below)
    zero2-resumed   warm       DeepSpeed ZeRO-2         2 x 2 x 2             zero2 resumed: the uninterrupted curve
    zero3           warm       DeepSpeed ZeRO-3         2 x 2 x 2             precomputed
    fsdp            warm       FSDP2                    1 x 4 x 2             precomputed (loss inside lm_head)
    single-lora     api        one process, LoRA        8 x 1 x 1             adapters_off
    zero3-lora      warm       DeepSpeed ZeRO-3, LoRA,  2 rows of 64 tokens   adapters_off (ZeRO-3 gathers the
                               packed                   x 2 x 2               base; loss inside lm_head)

(`train.cross_entropy: fused_linear` on two launches: the per-token log-probs computed inside lm_head
give the chunked loss's curve, on the engines that gather lm_head's weight in its forward. The zero3-lora
launch packs its pairs, `batch.tokens_per_micro_batch` = 2 rows of 64 tokens: each chosen and rejected
sequence a segment of a row; its loss is the padded one-process run's within 1e-6. The packed precomputed
reference pass is tests/unit/objectives/test_packed_units.py's.)

Per-step loss, rewards/* and eval/* agree within 2e-5; the metrics carry TRL's names in metrics.jsonl and
the offline W&B run; a resumed run reads its reference from the cache instead of a second pass.
"""

from __future__ import annotations

import signal

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

N_PAIRS, N_EVAL, GLOBAL, STEPS, SEED, LR, MAX_LEN = 24, 6, 8, 4, 5, 2e-3, 64
TOL, LOSS_TOL = 2e-5, 1e-6
Z2, Z3 = ("distributed.preset=zero2",), ("distributed.preset=zero3",)
FUSED = "train.cross_entropy=fused_linear"
LORA = ("lora.enabled=true", "lora.target_modules=all-linear")
FULL = [
    Launch(
        "single",
        "api",
        ("distributed.strategy=single", "batch.micro_batch_size=8", "logging.wandb.mode=offline"),
    ),
    Launch("zero2", "torchrun", (*Z2, "batch.micro_batch_size=2"), interrupt=(signal.SIGTERM, "group", 2)),
    Launch("zero3", "warm", (*Z3, "batch.micro_batch_size=2")),
    Launch("fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1", FUSED)),
]
ADAPTERS = [
    Launch("single-lora", "api", ("distributed.strategy=single", "batch.micro_batch_size=8", *LORA)),
    Launch(
        "zero3-lora",
        "warm",
        (*Z3, "batch.micro_batch_size=null", f"batch.tokens_per_micro_batch={2 * MAX_LEN}", *LORA, FUSED),
    ),
]
RESUMED = Launch(
    "zero2", "warm", (*Z2, "batch.micro_batch_size=2", "checkpoint.resume=true"), key="zero2-resumed"
)
# rewards/accuracies counts pairs whose chosen reward is above the rejected one: at step 1 the policy is the
# reference, every margin is 0 up to float noise (the reference pass batches pairs differently on every
# world size), so the step-1 count is a coin toss per engine; from step 2 on margins are far from 0.
CURVES = ("loss", *(m for m in METRICS if m != "rewards/accuracies"))
EVAL_CURVES = ("eval/loss", *(f"eval/{m}" for m in METRICS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("preference")
    config = write_config(
        root / "dpo.yaml",
        {
            "seed": SEED,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": GLOBAL},
            "distributed": {"strategy": "deepspeed"},
            "train": {"objective": "dpo", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": LR},
            "scheduler": {"name": "cosine", "warmup_steps": 1},
            "lora": {"enabled": False, "dropout": 0.0},
            "preference": {"beta": 0.5},
            "data": {
                "path": str(preference_pairs_file(root / "train.jsonl", N_PAIRS, 0)),
                "eval_path": str(preference_pairs_file(root / "eval.jsonl", N_EVAL, 1)),
                "max_seq_len": MAX_LEN,
            },
            "eval": {"every_steps": 2},
            "checkpoint": {"every_minutes": 0},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    results = run_launches([*FULL, *ADAPTERS], config, root / "runs")
    results.update(run_launches([RESUMED], config, root / "runs"))
    for key, result in results.items():
        if key != "zero2":  # the interrupted segment ends by its signal
            result.check()
    return results


@pytest.mark.parametrize(
    "name,ref",
    [("zero2-resumed", "single"), ("zero3", "single"), ("fsdp", "single"), ("zero3-lora", "single-lora")],
)
def test_one_dpo_curve_for_every_engine_and_split(runs: dict[str, RunResult], name: str, ref: str) -> None:
    run, base = runs[name], runs[ref]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    assert max_difference(metric_rows(run, CURVES), metric_rows(base, CURVES)) < TOL
    assert max_difference(metric_rows(run, EVAL_CURVES), metric_rows(base, EVAL_CURVES)) < TOL
    assert run.series("rewards/accuracies")[1:] == base.series("rewards/accuracies")[1:]
    assert run.series("tokens") == base.series("tokens")
    assert [row["eval/pairs"] for row in run.metrics if "eval/pairs" in row] == [N_EVAL, N_EVAL]


def test_the_splits_and_references_are_the_ones_asked(runs: dict[str, RunResult]) -> None:
    split = {
        r: (runs[r].metrics[-1]["micro_batch_size"], runs[r].metrics[-1]["grad_accum_steps"]) for r in runs
    }
    # zero3-lora: packed, 2 rows of 64 tokens per micro-batch (micro = rows), at most 2 micro-steps
    assert split["single"] == (8, 1) and split["fsdp"] == (1, 4) and split["zero3-lora"] == (2, 2)
    assert split["zero3"] == (2, 2)
    assert "reference: the base with the LoRA adapters off" in runs["zero3-lora"].stdout
    assert "reference log-probs of 30 pairs" in runs["fsdp"].stdout


def test_packed_pairs_on_2_ranks_give_the_padded_one_process_loss(runs: dict[str, RunResult]) -> None:
    packed, padded = runs["zero3-lora"], runs["single-lora"]
    assert "token budget 128 per micro-batch" in packed.stdout
    assert max_difference(metric_rows(packed, ("loss",)), metric_rows(padded, ("loss",))) < LOSS_TOL
    assert max_difference(metric_rows(packed, ("eval/loss",)), metric_rows(padded, ("eval/loss",))) < LOSS_TOL
    # Training moved the policy away from its reference, so the curves compared above are not flat.
    assert abs(runs["single"].metrics[-1]["rewards/margins"]) > 1e-3
    assert abs(runs["single-lora"].metrics[-1]["rewards/margins"]) > 1e-3


def test_sigterm_mid_dpo_then_resume_gives_the_uninterrupted_curve(runs: dict[str, RunResult]) -> None:
    stopped, resumed = runs["zero2"], runs["zero2-resumed"]
    assert "resume with the same command plus checkpoint.resume=true" in stopped.stdout
    assert "resumed from" in resumed.stdout
    # The resumed run scores its reference from the cache: the pass never sees the trained weights.
    assert "read from the cache, no pass" in resumed.stdout
    # (test_one_dpo_curve_for_every_engine_and_split: its whole metrics.jsonl equals the single run's.)


def test_metrics_carry_trl_names_in_metrics_jsonl_and_wandb(runs: dict[str, RunResult]) -> None:
    from zerofit.metrics.wandb_reader import read_wandb_run

    single = runs["single"]
    for row in single.metrics:
        assert set(METRICS) <= set(row) and 0 <= row["rewards/accuracies"] <= 1
    (run_file,) = (single.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = read_wandb_run(run_file).history
    last = history[max(history)]
    for name in (*METRICS, "loss", "eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"):
        assert last[name] == pytest.approx(single.metrics[-1][name], rel=1e-6), name
