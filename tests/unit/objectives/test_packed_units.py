"""Packed preference, KTO and reward-model micro-batches (`batch.tokens_per_micro_batch`) give the padded
layout's losses, metrics and updates: a few optimizer steps of one global batch, padded 8 x 1 against packed
into rows of 2 and 3 x `ROW` tokens, on the built-in tiny Llama in fp32 (transformers' sdpa reading the
segments off the restarting position ids): every step's loss within 1e-6 (relative above 1: a CPO loss of 8,
whose fp32 spacing is 1e-6), its metrics within 5e-6 (sums and differences of log-probs of 30 nats, whose
fp32 spacing is 4e-6: the sums are the same up to rounding, in another order).

Real components: the tiny Llama (causal LM and sequence classifier), peft's LoRA, zerofit's one-process
strategy and train step. The 2-rank cases are tests/distributed/test_{preference,kto,reward}_equivalence.py's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.config import load_config
from zerofit.data import IGNORE_INDEX, Example
from zerofit.data.packing import packed_unit_micro_batches
from zerofit.data.pairs import PreferencePair, pair_micro_batches
from zerofit.data.unpaired import UnpairedExample, kto_micro_batches
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.protocol import Objective
from zerofit.objectives.registry import objective_named

SEED, VOCAB, PAD, N, ROW, STEPS, TOL, METRIC_TOL = 3, 128, 0, 8, 24, 3, 1e-6, 5e-6
Batches = Callable[[int | None, int], list[dict[str, torch.Tensor]]]  # (row tokens, rows) -> micro-batches


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _sequence(g: torch.Generator, prompt: list[int], n: int) -> Example:
    response = [*_tokens(g, n), 2]
    return Example(prompt + response, [IGNORE_INDEX] * len(prompt) + response)


def _pairs() -> list[PreferencePair]:
    """Prompts of 2..10 tokens, responses of 1..10 (ragged), a margin on some; reference log-probs set."""
    out = []
    for i in range(N):
        g = torch.Generator().manual_seed(200 + i)
        prompt = [1, *_tokens(g, 2 + (7 * i) % 9)]
        chosen, rejected = _sequence(g, prompt, 1 + (3 * i) % 10), _sequence(g, prompt, 2 + (5 * i) % 9)
        pair = PreferencePair(chosen, rejected, margin=0.5 if i % 3 == 0 else None)
        pair.reference = (-40.0 - i, -38.0 + 0.5 * i)
        out.append(pair)
    return out


def _units() -> list[UnpairedExample]:
    out = []
    for i in range(N):
        g = torch.Generator().manual_seed(300 + i)
        prompt = [1, *_tokens(g, 2 + (7 * i) % 9)]
        completion = [*_tokens(g, 1 + (3 * i) % 10), 2]
        example = Example(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion)
        out.append(UnpairedExample(example, len(prompt), i % 3 != 1, ROW))
    return out


def _model(kind: str) -> torch.nn.Module:
    """The tiny Llama in fp32: a causal LM, with LoRA adapters that change it (`lora`), or a reward model."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from zerofit.models.lora import apply_lora, lora_config

    torch.manual_seed(SEED)
    if kind == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(
            ensure_tiny_llama(SEED), dtype=torch.float32, num_labels=1
        )
        model.config.pad_token_id = PAD
        return model
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(SEED), dtype=torch.float32)
    if kind == "lora":
        model = apply_lora(
            model, lora_config(r=4, alpha=8, dropout=0.0, target_modules="all-linear", use_dora=False), seed=1
        )
        with torch.no_grad():  # adapters that move the output: the reference (adapters off) differs
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.3)
    return model


def _objective(name: str, *overrides: str) -> Objective:
    cfg = load_config(None, [f"train.objective={name}", *overrides])
    return objective_named(name).build_loss(cfg)


def _curve(model: torch.nn.Module, objective: Objective, batches: list[dict[str, Any]]) -> list[list[float]]:
    """`STEPS` SGD steps on the same global batch: each step's loss and metric values."""
    model = copy.deepcopy(model)
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    out = []
    for _ in range(STEPS):
        result = train_step(strategy, model, batches, None, "chunked", objective)
        out.append([result.loss, *(result.metrics[k] for k in sorted(result.metrics))])
    return out


def _pair_batches(row_tokens: int | None, rows: int) -> list[dict[str, torch.Tensor]]:
    return pair_micro_batches(_pairs(), list(range(N)), rows, 1, 1, 0, PAD, row_tokens)


def _kto_batches(row_tokens: int | None, rows: int) -> list[dict[str, torch.Tensor]]:
    return kto_micro_batches(_units(), list(range(N)), rows, 1, 1, 0, PAD, row_tokens)


CASES = {
    "dpo-precomputed": (
        "full",
        ("dpo", "preference.reference=precomputed", "preference.loss_type=ipo"),
        _pair_batches,
    ),
    "dpo-adapters-off": (
        "lora",
        ("dpo", "preference.reference=adapters_off", "preference.beta=0.5"),
        _pair_batches,
    ),
    "simpo": ("full", ("simpo", "preference.simpo_gamma=0.3"), _pair_batches),
    "orpo-sequence": ("full", ("orpo", "preference.orpo_lambda=0.3"), _pair_batches),
    "orpo-response": ("full", ("orpo", "preference.orpo_prompt_loss=false"), _pair_batches),
    "cpo": ("full", ("cpo", "preference.beta=0.5"), _pair_batches),
    "kto": ("lora", ("kto", "kto.beta=0.5", "kto.undesirable_weight=1.5"), _kto_batches),
    "reward": ("reward", ("reward", "reward.center_rewards_coefficient=0.01"), _pair_batches),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_micro_batches_train_as_the_padded_ones(case: str) -> None:
    kind, (name, *overrides), batches = CASES[case]
    model = _model(kind)
    padded = _curve(model, _objective(name, *overrides), batches(None, N))
    for rows in (2, 3):
        packed_batches = batches(ROW, rows)
        assert all("position_ids" in b and "sequence_ids" in b for b in packed_batches)
        assert max(b["input_ids"].shape[1] for b in packed_batches) <= ROW
        packed = _curve(model, _objective(name, *overrides), packed_batches)
        assert len(packed[0]) == len(padded[0])
        for p, q in zip(packed, padded, strict=True):
            assert p[0] == pytest.approx(q[0], rel=TOL, abs=TOL), (case, rows)
            assert p[1:] == pytest.approx(q[1:], rel=METRIC_TOL, abs=METRIC_TOL), (case, rows)
    assert abs(padded[-1][0] - padded[0][0]) > 1e-4  # the steps moved the model: the curves are not flat


def test_a_pair_never_leaves_its_micro_batch_and_ranks_run_as_many() -> None:
    lengths = {i: (3 + (5 * i) % 17, 2 + (7 * i) % 19) for i in range(12)}
    for dp in (1, 2, 3):
        shares = [packed_unit_micro_batches(list(range(12)), lengths, 2, 20, dp, r) for r in range(dp)]
        assert len({len(s) for s in shares}) == 1  # every rank the same number of micro-steps
        seen = []
        for share in shares:
            for rows in share:
                assert len(rows) <= 2 and all(sum(lengths[u][k] for u, k in row) <= 20 for row in rows)
                segments = [s for row in rows for s in row]
                units = {u for u, _ in segments}
                assert sorted(segments) == sorted((u, k) for u in units for k in (0, 1))  # both, same micro
                seen += units
        assert sorted(seen) == list(range(12))
    # A pair whose two sequences share no row of a one-row budget gets a micro-batch of two rows.
    assert packed_unit_micro_batches([0], {0: (15, 15)}, 1, 20, 1, 0) == [[[(0, 0)], [(0, 1)]]]


def test_packed_pairs_number_their_segments_as_the_padded_rows() -> None:
    pairs = _pairs()[:3]
    (batch,) = pair_micro_batches(pairs, [0, 1, 2], 4, 1, 1, 0, PAD, 64)
    ids, m = batch["sequence_ids"], int(batch["pairs"])
    order = [i for i in range(m)]
    for k in order:  # chosen k is k, rejected m + k: the tokens of the same pair's sequences
        chosen = batch["input_ids"][ids == k].tolist()
        rejected = batch["input_ids"][ids == m + k].tolist()
        pair = next(p for p in pairs if p.chosen.input_ids == chosen)
        assert pair.rejected.input_ids == rejected
        assert float(batch["reference_logps"][k]) == pair.reference[0]  # type: ignore[index]
    # Each segment's first label is masked: nothing is predicted across two sequences of a row.
    starts = batch["position_ids"] == 0
    assert (batch["labels"][starts] == IGNORE_INDEX).all()
    (empty,) = pair_micro_batches(pairs, [], 4, 1, 1, 0, PAD, 64)
    assert int(empty["pairs"]) == 0 and empty["sequence_ids"].tolist() == [[0]]


def test_the_reference_pass_packs_as_training_does() -> None:
    """Under a token budget the precomputed reference is scored from packed rows: the padded pass's table
    within 1e-6 relative, in fewer forwards than pairs."""
    from zerofit.loop.reference import _forwards, _score

    model, pairs = _model("full"), _pairs()
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    padded = _score(strategy, model, pairs, 1, PAD, "chunked")
    packed = _score(strategy, model, pairs, 3, PAD, "chunked", ROW)
    torch.testing.assert_close(packed, padded, rtol=1e-6, atol=1e-6)
    forwards = list(_forwards(pairs, 3, PAD, 1, 0, ROW))
    assert len(forwards) < N and sorted(i for idx, _ in forwards for i in idx) == list(range(N))


@pytest.mark.parametrize("objective", ["dpo", "kto", "reward"])
def test_resolve_accepts_a_token_budget_for_pairs_and_unpaired_examples(objective: str) -> None:
    from pathlib import Path

    from zerofit.resolution import resolve

    data = {"kto": "demo_kto.jsonl"}.get(objective, "demo_preference.jsonl")
    overrides = [
        f"data.path={Path(__file__).parents[3] / 'data' / data}",
        f"train.objective={objective}",
        "lora.enabled=true",
        "distributed.strategy=single",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=null",
        "batch.tokens_per_micro_batch=1024",
        "data.max_seq_len=256",
    ]
    resolved = resolve(load_config(None, overrides), 1)
    assert resolved.config.batch.tokens_per_micro_batch == 1024 and resolved.batch.micro_batch_size == 4
