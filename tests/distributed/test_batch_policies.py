"""Partial last window dropped (the default) and opt-in LR scaling, in one-process runs of the Python API
(`zerofit.train`, in the test process: what the command line prints is captured the same).

The normalized partial window is covered across every split and engine in test_equivalence.py; here the
default policy: 20 examples with global batch 8 give 2 full windows per epoch, the 4 left over are never
trained on (said once at start), and the next epoch starts a fresh order instead of receiving them.

    launch        launcher   what
    drop-linear   api        the default drop policy; `optimizer.lr_scaling: linear` from base batch 4
    sqrt          api        `optimizer.lr_scaling: sqrt` from base batch 32
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_helpers import Launch, RunResult, run_launches, varied_length_data, write_config
from zerofit.data import GlobalBatchSampler, collate, load_sft_dataset
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.strategies.optim import lr_multiplier
from zerofit.token_loss.sums import count_label_tokens

pytestmark = [pytest.mark.distributed]

N, GLOBAL, STEPS, SEED, LR, MAX_LEN = 20, 8, 4, 5, 1e-3, 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("policies")
    data = varied_length_data(root / "twenty.jsonl", N, seed=1)
    config = write_config(
        root / "policies.yaml",
        {
            "seed": SEED,
            "batch": {"global_batch_size": GLOBAL, "micro_batch_size": 4},
            "distributed": {"strategy": "single"},
            "train": {"max_steps": STEPS, "precision": "fp32"},
            "optimizer": {"lr": LR},
            "scheduler": {"name": "linear", "warmup_steps": 2},
            "data": {"path": str(data), "max_seq_len": MAX_LEN},
            "checkpoint": {"save_final": False},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    return data, config


@pytest.fixture(scope="module")
def runs(setup: tuple[Path, Path]) -> dict[str, RunResult]:
    _, config = setup
    launches = [
        Launch("drop-linear", "api", ("optimizer.lr_scaling=linear", "optimizer.base_batch_size=4")),
        Launch("sqrt", "api", ("optimizer.lr_scaling=sqrt", "optimizer.base_batch_size=32")),
    ]
    results = run_launches(launches, config, config.parent / "runs")
    return {name: result.check() for name, result in results.items()}


def test_drop_skips_the_short_window_and_says_so(
    runs: dict[str, RunResult], setup: tuple[Path, Path]
) -> None:
    from transformers import AutoTokenizer

    data, _ = setup
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_llama(SEED))
    examples, _ = load_sft_dataset(data, tokenizer, MAX_LEN)
    sampler = GlobalBatchSampler(N, GLOBAL, SEED, partial_window="drop")
    expected = [
        count_label_tokens(collate([examples[i] for i in sampler.batch_indices(s)], 0)["labels"])
        for s in range(STEPS)
    ]
    run = runs["drop-linear"]
    assert run.series("epoch") == [0, 0, 1, 1]  # 2 full windows per epoch; the 4 left over never leak
    assert run.series("partial_window") == [False] * STEPS
    assert run.series("tokens") == expected
    notices = [line for line in run.stdout.splitlines() if "partial window 'drop'" in line]
    assert len(notices) == 1 and f"last {N % GLOBAL} of {N} examples" in notices[0]


@pytest.mark.parametrize(("name", "scale"), [("drop-linear", GLOBAL / 4), ("sqrt", (GLOBAL / 32) ** 0.5)])
def test_lr_scaling_is_applied_once_and_scheduled_per_step(
    runs: dict[str, RunResult], name: str, scale: float
) -> None:
    factor = lr_multiplier("linear", 2, STEPS, 0.0)
    assert runs[name].series("lr") == pytest.approx([LR * scale * factor(s) for s in range(STEPS)], rel=1e-9)
    assert f"lr {LR * scale:.3g}" in runs[name].stdout  # the plan prints the effective LR
