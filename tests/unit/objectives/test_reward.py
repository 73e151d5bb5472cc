"""`train.objective: reward` (zerofit.objectives.reward_model.loss): the Bradley-Terry loss by hand (margin and
centering included), the reward at each row's last real token, the same fp32 loss curve whatever the split
(8 x 1 vs 2 x 4 on ragged pairs), a per-micro-batch mean that disagrees, and TRL's RewardTrainer's per-step
losses at accumulation 1."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.data import IGNORE_INDEX, Example
from zerofit.data.pairs import PreferencePair, collate_pairs
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.reward_model.loss import REWARD_METRICS, RewardObjective, pair_rewards, reward_losses

SEED, VOCAB, PAD = 3, 128, 0
CENTER, LR = 0.01, 1e-2


def _reward_model() -> torch.nn.Module:
    """The built-in tiny Llama as a one-output sequence classifier, its score head seeded (as a run builds it)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(SEED)
    model = AutoModelForSequenceClassification.from_pretrained(
        ensure_tiny_llama(SEED), dtype=torch.float32, num_labels=1
    )
    model.config.pad_token_id = PAD
    return model


def _pair(i: int) -> PreferencePair:
    """Prompts of 2..6 tokens, responses of 1..8 tokens (ragged rows), a margin on every other pair."""
    g = torch.Generator().manual_seed(100 + i)
    prompt = [1, *torch.randint(3, VOCAB, (2 + i % 5,), generator=g).tolist()]

    def seq(n: int) -> Example:
        response = [*torch.randint(3, VOCAB, (n,), generator=g).tolist(), 2]
        return Example(prompt + response, [IGNORE_INDEX] * len(prompt) + response)

    margin = 0.25 * (i % 3) if i % 2 else None
    return PreferencePair(seq(1 + (3 * i) % 7), seq(2 + (5 * i) % 6), margin=margin)


def test_the_loss_by_hand() -> None:
    """-log sigmoid(r_c - r_r - margin) + c (r_c + r_r)^2 per pair, written out."""
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.2, 0.5, -1.0])
    margin = torch.tensor([0.3, 0.0, 1.5])
    expected = [
        math.log1p(math.exp(-(c - r - m))) + CENTER * (c + r) ** 2
        for c, r, m in zip(chosen.tolist(), rejected.tolist(), margin.tolist(), strict=True)
    ]
    got = reward_losses(chosen, rejected, margin, CENTER)
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    plain = reward_losses(chosen, rejected)  # no margin, no centering: plain Bradley-Terry
    assert plain.tolist() == pytest.approx(
        [math.log1p(math.exp(-(c - r))) for c, r in [(1, 0.2), (-0.5, 0.5), (2, -1)]]
    )


def test_terms_score_each_row_at_its_last_real_token() -> None:
    """The padded micro-batch's per-pair sums equal scoring each sequence alone, unpadded (pooling by pad id)."""
    model, pairs = _reward_model().eval(), [_pair(i) for i in range(4)]
    batch = collate_pairs(pairs, PAD)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        (loss_sum,), sums = RewardObjective(CENTER).terms(model, inputs, batch, "chunked")
        alone = [
            float(pair_rewards(model, {"input_ids": torch.tensor([e.input_ids])})[0])
            for e in [p.chosen for p in pairs] + [p.rejected for p in pairs]
        ]
    c, r = torch.tensor(alone[:4]), torch.tensor(alone[4:])
    margin = torch.tensor([p.margin or 0.0 for p in pairs])
    assert float(loss_sum) == pytest.approx(float(reward_losses(c, r, margin, CENTER).sum()), abs=1e-5)
    expected = [c.sum(), r.sum(), (c > r).sum(), (c - r).sum()]
    assert sums.tolist() == pytest.approx([float(x) for x in expected], abs=1e-5)


def _adamw_strategy(model: torch.nn.Module) -> Any:
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    return strategy


def _curve(pairs: list[PreferencePair], per_step: int, micro: int, steps: int) -> list[dict[str, float]]:
    """`steps` optimizer steps of `per_step` pairs each, in micro-batches of `micro`: loss and metrics."""
    model = _reward_model()
    strategy, objective, rows = _adamw_strategy(model), RewardObjective(CENTER), []
    for step in range(steps):
        window = pairs[step * per_step : (step + 1) * per_step]
        batches = [collate_pairs(window[k : k + micro], PAD) for k in range(0, len(window), micro)]
        result = train_step(strategy, model, batches, None, "chunked", objective)
        rows.append({"loss": result.loss, **result.metrics})
    return rows


@pytest.fixture(scope="module")
def ragged_pairs() -> list[PreferencePair]:
    return [_pair(i) for i in range(24)]


@pytest.mark.slow  # 16 micro-steps of a real model (~10 s on 2 busy cores); the [3, 1] split below is fast
def test_the_split_gives_the_same_loss_curve(ragged_pairs: list[PreferencePair]) -> None:
    """Global batch 8: 8 micro-batches of 1 pair vs 2 of 4, three AdamW steps, fp32: the same curve."""
    one_by_one = _curve(ragged_pairs, 8, 1, 3)
    four_by_two = _curve(ragged_pairs, 8, 4, 3)
    assert set(one_by_one[0]) == {"loss", *REWARD_METRICS}
    assert one_by_one[0]["loss"] != pytest.approx(one_by_one[-1]["loss"], abs=1e-3)  # it trained
    for a, b in zip(one_by_one, four_by_two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=2e-5)
        # The rewards after AdamW steps: its per-weight normalization lifts fp32 rounding (padded vs unpadded
        # rows) a little more than the loss shows.
        assert a == pytest.approx(b, abs=1e-4)


def test_a_per_micro_batch_mean_disagrees(ragged_pairs: list[PreferencePair]) -> None:
    """Micro-batches of 3 and 1 pairs: the mean of per-micro-batch means (TRL's accumulation) is not the
    global batch's mean over its 4 pairs; train_step's is."""
    model, pairs, objective = _reward_model(), ragged_pairs[:4], RewardObjective(CENTER)
    whole = _curve(pairs, 4, 4, 1)[0]["loss"]
    split = _curve(pairs, 4, 3, 1)[0]["loss"]  # micro-batches [3, 1]
    naive = 0.0
    for part in (pairs[:3], pairs[3:]):
        batch = collate_pairs(part, PAD)
        with torch.no_grad():
            (term,), _ = objective.terms(
                model, {k: batch[k] for k in ("input_ids", "attention_mask")}, batch, ""
            )
        naive += float(term) / len(part) / 2
    assert split == pytest.approx(whole, abs=2e-6)
    assert abs(naive - whole) > 1e-3, (naive, whole)


@pytest.mark.slow  # importing TRL and building its Trainer take seconds
def test_equals_trls_reward_trainer_at_accumulation_1(
    ragged_pairs: list[PreferencePair], tmp_path: Path
) -> None:
    """TRL 1.16's RewardTrainer on the same tokens (pre-tokenized chosen_ids / rejected_ids, the margin
    column), the same model, AdamW, constant lr, 4 pairs per step, no accumulation, in order: the same
    per-step losses. (TRL tokenizes text itself, prompt + response as one string with eos appended; zerofit
    tokenizes prompt and response apart: the same data can differ in tokens at the seam, not in the loss.)"""
    pytest.importorskip("trl")
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    steps, per_step = 4, 4
    pairs = ragged_pairs[: steps * per_step]
    rows = {
        "chosen_ids": [p.chosen.input_ids for p in pairs],
        "rejected_ids": [p.rejected.input_ids for p in pairs],
        "margin": [p.margin or 0.0 for p in pairs],
    }
    args = RewardConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping, as train_step(max_grad_norm=None)
        optim="adamw_torch",
        center_rewards_coefficient=CENTER,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        save_strategy="no",
        seed=SEED,
    )
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_llama(SEED))
    trainer = RewardTrainer(
        model=_reward_model(), args=args, train_dataset=Dataset.from_dict(rows), processing_class=tokenizer
    )
    trainer._get_train_sampler = lambda *a, **k: SequentialSampler(trainer.train_dataset)  # type: ignore[method-assign]
    trainer.train()
    trl_losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    trl_accuracy = [row["accuracy"] for row in trainer.state.log_history if "accuracy" in row]
    ours = _curve(pairs, per_step, per_step, steps)
    assert len(trl_losses) == steps
    assert [r["loss"] for r in ours] == pytest.approx(trl_losses, abs=2e-5)
    assert [r["rewards/accuracies"] for r in ours] == pytest.approx(trl_accuracy, abs=1e-6)
    assert copy.deepcopy(ours)  # rows are plain floats
