"""Token-budget micro-batches: every example of a global batch exactly once, balanced over ranks, packed
whole into rows; and packed rows give the padded batch's loss and gradients (fp32, 1e-5) because attention
and positions stay within each example."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.data import (
    Example,
    GlobalBatchSampler,
    collate,
    collate_packed,
    model_inputs,
    packed_micro_batches,
)
from zerofit.data.packing import deal_to_ranks, pack_rows
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.token_loss.sums import IGNORE_INDEX, count_label_tokens, token_sum_loss

ROW = 64  # data.max_seq_len of these tests


def _examples(n: int = 24, seed: int = 0) -> list[Example]:
    """Examples of 2..64 tokens with masked prompts of varied length (bos first, like tokenize_example)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([2, 3, 7, 15, 30, 45, 64])
        ids = [1] + [rng.randrange(3, 128) for _ in range(length - 1)]
        prompt = rng.randrange(1, length)
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def _lengths(examples: list[Example]) -> dict[int, int]:
    return {i: len(e.input_ids) for i, e in enumerate(examples)}


@pytest.mark.parametrize(("dp", "rows_per_micro"), [(1, 1), (1, 4), (2, 2), (3, 1), (4, 3)])
def test_every_example_once_same_micro_steps_on_every_rank(dp: int, rows_per_micro: int) -> None:
    examples = _examples()
    lengths = _lengths(examples)
    indices = GlobalBatchSampler(len(examples), 24, seed=3).batch_indices(0)
    per_rank = [packed_micro_batches(indices, lengths, rows_per_micro, ROW, dp, r) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1  # collectives stay matched
    # Never more micro-steps than the split's accumulation (micro = rows per micro-batch).
    assert len(per_rank[0]) <= len(indices) // dp // rows_per_micro + 1
    placed = [i for p in per_rank for micro in p for row in micro for i in row]
    assert sorted(placed) == sorted(indices)
    for p in per_rank:
        for micro in p:
            assert len(micro) <= rows_per_micro
            assert all(sum(lengths[i] for i in row) <= ROW for row in micro)
    shares = deal_to_ranks(indices, lengths, dp)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    tokens = [sum(lengths[i] for i in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(lengths.values())  # snake dealing balances the tokens


def test_first_fit_decreasing_fills_rows() -> None:
    lengths = {0: 40, 1: 30, 2: 24, 3: 20, 4: 10, 5: 4}
    assert pack_rows(list(lengths), lengths, 64) == [[0, 2], [1, 3, 4, 5]]
    with pytest.raises(ValueError, match="more than a row"):
        pack_rows([0], {0: 65}, 64)


def test_collate_packed_restarts_positions_and_masks_each_first_label() -> None:
    a = Example([1, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 6, 7])
    b = Example([1, 8, 9], [IGNORE_INDEX, 8, 9])
    c = Example([1, 4], [IGNORE_INDEX, 4])
    batch = collate_packed([[a, b], [c]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 1, 8, 9], [1, 4, 0, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4]]
    assert batch["attention_mask"].tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0]]
    n = IGNORE_INDEX
    assert batch["labels"].tolist() == [[n, n, 6, 7, n, 8, 9], [n, 4, n, n, n, n, n]]
    assert count_label_tokens(batch["labels"]) == count_label_tokens(collate([a, b, c], 0)["labels"])
    assert set(model_inputs(batch, torch.device("cpu"))) == {"input_ids", "position_ids"}  # no 2-D mask
    empty = collate_packed([], 0)  # a rank with nothing left this step: one dummy row, not a useful token
    assert empty["input_ids"].tolist() == [[0]] and int(empty["attention_mask"].sum()) == 0


def _loss_and_grads(model: Any, batches: list[dict[str, torch.Tensor]], mask_instead: bool = False) -> Any:
    model.zero_grad(set_to_none=True)
    tokens = sum(count_label_tokens(b["labels"]) for b in batches)
    total = 0.0
    for batch in batches:
        inputs = model_inputs(batch, torch.device("cpu"))
        if mask_instead:  # what packing without per-document attention would compute
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        loss = token_sum_loss(model(**inputs, use_cache=False).logits, batch["labels"])
        (loss / tokens).backward()
        total += float(loss.detach())
    return total / tokens, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.slow
def test_packed_rows_give_the_padded_batch_loss_and_gradients() -> None:
    """tiny-llama in fp32: one global batch of 24 examples as padded micro-batches of 4, and packed under
    token budgets of 1, 2 and 4 rows: same loss and gradient within 1e-5. Packing with a plain mask (attention
    across examples) would not agree, so the comparison can fail."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(0), dtype=torch.float32)
    examples = _examples()
    indices = list(range(len(examples)))
    padded = [collate([examples[i] for i in indices[k : k + 4]], 0) for k in range(0, 24, 4)]
    ref_loss, ref_grad = _loss_and_grads(model, padded)
    lengths = _lengths(examples)
    for rows in (1, 2, 4):
        micro = packed_micro_batches(indices, lengths, rows, ROW, 1, 0)
        packed = [collate_packed([[examples[i] for i in row] for row in m], 0) for m in micro]
        assert sum(b["input_ids"].numel() for b in packed) < sum(b["input_ids"].numel() for b in padded)
        loss, grad = _loss_and_grads(model, packed)
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        assert float((grad - ref_grad).abs().max()) < 1e-5, rows
    crossing_loss, _ = _loss_and_grads(model, packed, mask_instead=True)
    assert abs(crossing_loss - ref_loss) > 1e-3


class _Sink:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append(metrics)

    def log_config(self, config: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _NoCheckpoints:
    def after_step(self, steps_done: int, stopping: bool = False, tokens_seen: int | None = None) -> None: ...


def test_train_loop_with_a_token_budget_logs_useful_and_processed_tokens() -> None:
    """The loop's packed path (`LoopInputs.packed_row_tokens`) trains the same global batches as the padded
    one, and metrics.jsonl says what padding cost: processed > useful tokens, less so when packed."""
    from transformers import AutoModelForCausalLM

    from zerofit.config.batching import solve_batch
    from zerofit.loop.train import LoopInputs, train_loop

    examples = _examples()
    rows: dict[str, list[dict[str, Any]]] = {}
    results = {}
    for name, row_tokens in (("padded", None), ("packed", ROW)):
        model = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(0), dtype=torch.float32)
        strategy = one_process_strategy()
        strategy.prepare(
            model,
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        )
        sink = _Sink()
        run = LoopInputs(
            strategy=strategy,
            model=model,
            examples=examples,
            sampler=GlobalBatchSampler(len(examples), 12, seed=0),
            batch=solve_batch(1, 12, 4),
            max_steps=2,
            max_grad_norm=None,
            pad_id=0,
            sink=sink,
            checkpointer=_NoCheckpoints(),
            packed_row_tokens=row_tokens,
        )
        results[name] = train_loop(run)
        rows[name] = sink.rows
    for padded, packed in zip(results["padded"], results["packed"], strict=True):
        assert packed.tokens == padded.tokens and packed.input_tokens == padded.input_tokens
        assert packed.loss == pytest.approx(padded.loss, abs=1e-5)  # step 2 also checks the update
        assert padded.input_tokens <= packed.processed_tokens < padded.processed_tokens
    for metrics in rows["packed"] + rows["padded"]:
        assert metrics["processed_tokens_per_s"] >= metrics["useful_tokens_per_s"] > metrics["tokens_per_s"]
