"""The evaluation loss: token-exact over all ranks, normalized exactly as the training loss is.

    evaluation_loss: the eval examples in windows of micro_batch_size x dp -> each rank its micro-batch of
                     every window (`split_global_batch`; an empty one runs a masked dummy row, so every rank
                     runs the same forwards and the engines' collectives stay matched) -> forward without
                     gradients in the training forward's context -> token-loss sums and valid-token counts
                     (`zerofit.loss`; inside lm_head for `fused_linear`) -> one all-reduce -> sum / tokens.

So the number is the mean over every valid label token of the eval data, whatever the split: 2 ranks x
micro 2 and 1 rank x micro 4 give the same loss (up to float summation order). The model is put in eval
mode (no dropout) for the pass and back in train mode after it.

`Evaluator` is the loop's hook (`zerofit.train.Evaluating`): every `eval.every_steps` optimizer steps and
after the last one, it returns the `eval/*` fields of that step's metrics row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from zerofit.data import Example, collate, split_global_batch
from zerofit.fused_loss import FUSED_LINEAR, forward_token_sum
from zerofit.loss import count_label_tokens
from zerofit.strategies.base import Strategy

__all__ = ["EvalResult", "Evaluator", "evaluation_loss"]


@dataclass(frozen=True)
class EvalResult:
    """Mean loss over the eval data's valid label tokens, how many there were, and the examples evaluated."""

    loss: float
    tokens: int
    examples: int


def evaluation_loss(
    strategy: Strategy,
    model: torch.nn.Module,
    examples: list[Example],
    micro_batch_size: int,
    pad_id: int,
    cross_entropy: str = "chunked",
) -> EvalResult:
    """The loss of `model` over all `examples` (collective: every rank calls it with the same examples).

    `cross_entropy` is `train.cross_entropy`: `fused_linear` evaluates inside lm_head too (no logits at
    evaluation either); every other choice evaluates with the chunked loss (the same sums; Liger's kernel
    would write gradients that no evaluation needs).
    """
    impl = FUSED_LINEAR if cross_entropy == FUSED_LINEAR else "chunked"
    dp, rank = strategy.world_size, strategy.rank
    window = micro_batch_size * dp
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=strategy.device)
    tokens = 0
    try:
        with torch.no_grad():
            for start in range(0, len(examples), window):
                indices = list(range(start, min(start + window, len(examples))))
                (mine,) = split_global_batch(indices, micro_batch_size, 1, dp, rank)
                batch = collate([examples[i] for i in mine], pad_id)
                # The training forward's context (autocast where the engine uses it); `is_last` so no engine
                # defers anything: without gradients there is nothing to synchronize.
                with strategy.accumulate(is_last=True):
                    inputs = {
                        "input_ids": batch["input_ids"].to(strategy.device),
                        "attention_mask": batch["attention_mask"].to(strategy.device),
                    }
                    loss_sum += forward_token_sum(model, inputs, batch["labels"], impl).double()
                tokens += count_label_tokens(batch["labels"])
    finally:
        model.train(was_training)
    # One all-reduce of (loss sum, tokens): float64 holds token counts exactly far beyond any eval set.
    local = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64, device=strategy.device)])
    total_loss, total_tokens = (float(x) for x in strategy.all_reduce_sum(local))
    return EvalResult(
        loss=total_loss / max(total_tokens, 1.0), tokens=int(total_tokens), examples=len(examples)
    )


@dataclass
class Evaluator:
    """Evaluates every `every_steps` optimizer steps (0: never in between) and after the last step."""

    strategy: Strategy
    model: torch.nn.Module
    examples: list[Example]
    micro_batch_size: int
    pad_id: int
    every_steps: int
    max_steps: int
    cross_entropy: str = "chunked"  # train.cross_entropy (see `evaluation_loss`)

    def due(self, steps_done: int) -> bool:
        """Whether the evaluation runs after optimizer step `steps_done` (1-based)."""
        periodic = self.every_steps > 0 and steps_done % self.every_steps == 0
        return periodic or steps_done == self.max_steps

    def after_step(self, steps_done: int) -> dict[str, Any]:
        """The `eval/*` metrics after step `steps_done`, or {} when no evaluation is due (collective)."""
        if not self.due(steps_done):
            return {}
        started = time.perf_counter()
        result = evaluation_loss(
            self.strategy, self.model, self.examples, self.micro_batch_size, self.pad_id, self.cross_entropy
        )
        return {
            "eval/loss": result.loss,
            "eval/tokens": result.tokens,
            "eval/time_s": time.perf_counter() - started,
        }
