"""The evaluation loss: token-exact over all ranks, normalized exactly as the training loss is.

    evaluation_loss: the eval examples in windows of micro_batch_size x dp -> each rank its micro-batch of
                     every window (`split_global_batch`; an empty one runs a masked dummy row, so every rank
                     runs the same forwards and the engines' collectives stay matched) -> forward without
                     gradients in the training forward's context -> token-loss sums and valid-token counts
                     (`zerofit.token_loss.sums`; inside lm_head for `fused_linear`) -> one all-reduce -> sum / tokens.

So the number is the mean over every valid label token of the eval data, whatever the split: 2 ranks x
micro 2 and 1 rank x micro 4 give the same loss (up to float summation order). The model is put in eval
mode (no dropout) for the pass and back in train mode after it.

With an objective on pairs (`zerofit.objectives.pairwise`, reward models) the eval data is held-out pairs: `preference_evaluation`
runs the objective's own sums and counts over windows of micro_batch_size pairs x dp, one all-reduce, so
`eval/loss` is the objective's loss over every held-out pair (ORPO: its NLL over every held-out chosen
token) and `eval/rewards/*`, `eval/logps/*` are means over every held-out pair, whatever the split.

With an RL objective (GRPO) the eval data is held-out prompts: `zerofit.loop.held_out` has the policy answer
each one and the run's reward functions score the answers (`eval/reward`, `eval/rewards/*`, exact over ranks).

`Evaluator` is the loop's hook (`zerofit.loop.train.Evaluating`): every `eval.every_steps` optimizer steps and
after the last one, it returns the `eval/*` fields of that step's metrics row.

An evaluation over 0 valid label tokens (or 0 pairs) is an error, never an `eval/loss` of 0.0: that number
would be the best so far, and keeping it would prune the checkpoint that really is the best.
`check_eval_data` refuses such eval data when it is loaded (before the model), and both evaluations raise
the same `DataError` should the global count still be 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from zerofit.core.errors import DataError
from zerofit.data import Example, collate, model_inputs, split_global_batch
from zerofit.data.pairs import PreferencePair, collate_pairs
from zerofit.data.sft import has_labels
from zerofit.data.unpaired import UnpairedExample
from zerofit.levers.sequence_parallel import shard_micro_batch
from zerofit.loop.held_out import held_out_rewards
from zerofit.loop.rollout import Rollouts
from zerofit.loop.unpaired import kto_evaluation
from zerofit.metrics.keys import EVAL_LOSS
from zerofit.objectives.protocol import Objective
from zerofit.strategies.base import Strategy
from zerofit.token_loss.fused import FUSED_LINEAR, forward_token_sum
from zerofit.token_loss.sums import batch_labels, count_label_tokens

__all__ = [
    "EvalResult",
    "Evaluator",
    "check_eval_data",
    "evaluation_due",
    "evaluation_loss",
    "preference_evaluation",
]


@dataclass(frozen=True)
class EvalResult:
    """Mean loss over the eval data's valid label tokens, how many there were, and the examples evaluated."""

    loss: float
    tokens: int
    examples: int


def no_eval_tokens(what: str) -> DataError:
    """The error for evaluation data that leaves nothing to score (`what`: what it holds)."""
    return DataError(
        f"the evaluation data (data.eval_path or data.eval_split) holds {what}, so there is no valid "
        "label token to score: eval/loss would be 0.0 over 0 tokens, count as the best evaluation and let "
        "checkpoint pruning delete the checkpoint that really is the best. This happens when every label "
        "of the eval examples is masked (prompt-only records, a damaged tokenization cache entry), when "
        "data.eval_split holds out too few records, or when data.max_seq_len cuts off every response; use "
        "eval data with responses (a larger data.eval_split or another data.eval_path), raise "
        "data.max_seq_len, or delete the tokenization cache entry ($ZEROFIT_CACHE/tokenized/) to have the "
        "data tokenized again."
    )


def check_eval_data(units: list[Example] | list[PreferencePair]) -> None:
    """Refuse evaluation data with no valid label token (for pairs: a pair whose chosen or rejected
    response has none, since each pair's log-probs need both), before anything is trained or evaluated."""
    if not units:
        raise no_eval_tokens("no examples")
    if isinstance(units[0], PreferencePair):
        pairs: list[Any] = units
        empty = sum(not (has_labels(p.chosen.labels) and has_labels(p.rejected.labels)) for p in pairs)
        if empty:
            raise no_eval_tokens(f"{empty} of {len(pairs)} pairs with a response whose labels are all masked")
        return
    examples: list[Any] = units
    if not any(has_labels(e.labels) for e in examples):
        raise no_eval_tokens(f"{len(examples)} examples whose labels are all masked")


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
    # Sequence parallelism: a group's ranks evaluate the same examples, each its shard of every sequence.
    dp, rank = strategy.dp_world_size, strategy.dp_rank
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
                batch = _eval_batch(strategy, [examples[i] for i in mine], micro_batch_size, pad_id)
                labels, shifted = batch_labels(batch)
                # The training forward's context (autocast where the engine uses it); `is_last` so no engine
                # defers anything: without gradients there is nothing to synchronize.
                with strategy.accumulate(is_last=True):
                    inputs = model_inputs(batch, strategy.device)
                    loss_sum += forward_token_sum(model, inputs, labels, impl, shifted).double()
                tokens += count_label_tokens(labels, shifted)
    finally:
        model.train(was_training)
    # One all-reduce of (loss sum, tokens): float64 holds token counts exactly far beyond any eval set.
    local = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64, device=strategy.device)])
    total_loss, total_tokens = (float(x) for x in strategy.all_reduce_sum(local))
    if total_tokens == 0:  # the same global count on every rank: every rank raises
        raise no_eval_tokens(f"{len(examples)} examples whose labels are all masked")
    return EvalResult(loss=total_loss / total_tokens, tokens=int(total_tokens), examples=len(examples))


def _eval_batch(
    strategy: Strategy, examples: list[Example], micro_batch_size: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """A collated eval micro-batch, or this rank's shard of it under sequence parallelism."""
    batch = collate(examples, pad_id)
    if strategy.sp_size == 1:
        return batch
    return shard_micro_batch(batch, strategy.sp_size, strategy.sp_rank, micro_batch_size, pad_id)


def preference_evaluation(
    strategy: Strategy,
    model: torch.nn.Module,
    pairs: list[PreferencePair],
    objective: Objective,
    micro_batch_size: int,
    pad_id: int,
    cross_entropy: str = "chunked",
) -> dict[str, Any]:
    """`eval/loss` and `eval/<metric>` of `objective` over every pair of `pairs` (collective, exact over ranks)."""
    impl = FUSED_LINEAR if cross_entropy == FUSED_LINEAR else "chunked"
    # Sequence parallelism: a group's ranks evaluate the same examples, each its shard of every sequence.
    dp, rank = strategy.dp_world_size, strategy.dp_rank
    window = micro_batch_size * dp
    was_training = model.training
    model.eval()
    counts = [0] * len(objective.counts([]))
    sums: torch.Tensor | None = None
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), window):
                indices = list(range(start, min(start + window, len(pairs))))
                (mine,) = split_global_batch(indices, micro_batch_size, 1, dp, rank)
                batch = collate_pairs([pairs[i] for i in mine], pad_id)
                with strategy.accumulate(is_last=True):  # the training forward's context, nothing deferred
                    inputs = model_inputs(batch, strategy.device)  # a vision model's pairs: their images too
                    terms, metric_sums = objective.terms(model, inputs, batch, impl)
                local = torch.cat([torch.stack([t.double() for t in terms]), metric_sums])
                sums = local if sums is None else sums + local
                counts = [a + b for a, b in zip(counts, objective.counts([batch]), strict=True)]
    finally:
        model.train(was_training)
    if sums is None:
        raise no_eval_tokens("no pairs")
    # One all-reduce of the sums and counts (fp64 holds the counts exactly far beyond any eval set).
    count_t = torch.tensor(counts, dtype=torch.float64, device=sums.device)
    total = strategy.all_reduce_sum(torch.cat([sums, count_t])).tolist()
    n = len(counts)
    global_counts = total[-n:]
    if min(global_counts) == 0:  # the same global counts on every rank: every rank raises
        raise no_eval_tokens(f"{len(pairs)} pairs with no response token to score")
    loss = sum(t / c for t, c in zip(total[:n], global_counts, strict=True))
    metrics = objective.metric_means(total[n:-n], int(global_counts[-1]), prefix="eval/")
    return {EVAL_LOSS: loss, "eval/pairs": int(global_counts[-1]), **metrics}


def evaluation_due(steps_done: int, every_steps: int, max_steps: int) -> bool:
    """Whether an evaluation (held-out loss or reward, the lm-eval harness) runs after optimizer step
    `steps_done` (1-based): every `every_steps` steps (0: never periodically), and after the last step."""
    periodic = every_steps > 0 and steps_done % every_steps == 0
    return periodic or steps_done == max_steps


@dataclass
class Evaluator:
    """Evaluates every `every_steps` optimizer steps (0: never in between) and after the last step."""

    strategy: Strategy
    model: torch.nn.Module
    examples: list[Example] | list[PreferencePair]  # pairs with a preference objective
    micro_batch_size: int
    pad_id: int
    every_steps: int
    max_steps: int
    cross_entropy: str = "chunked"  # train.cross_entropy (see `evaluation_loss`)
    objective: Objective | None = None  # train.objective's loss (pairs and unpaired units are scored by it)
    rollouts: Rollouts | None = None  # an RL objective's: held-out prompts are answered and rewarded
    sampling: str = "seeded"  # eval.sampling (an RL objective's held-out answers, `zerofit.loop.held_out`)

    def due(self, steps_done: int) -> bool:
        """Whether the evaluation runs after optimizer step `steps_done` (1-based)."""
        return evaluation_due(steps_done, self.every_steps, self.max_steps)

    def after_step(self, steps_done: int) -> dict[str, Any]:
        """The `eval/*` metrics after step `steps_done`, or {} when no evaluation is due (collective)."""
        if not self.due(steps_done):
            return {}
        started = time.perf_counter()
        first = self.examples[0] if self.examples else None
        if (
            self.rollouts is not None
        ):  # an RL objective: the held-out prompts' reward (`zerofit.loop.held_out`)
            b = self.rollouts.batch
            prompts: list[Any] = self.examples
            per_rank = b.micro_batch_size * b.grad_accum_steps
            fields = held_out_rewards(
                self.strategy, self.rollouts, prompts, per_rank, steps_done, self.sampling
            )
            return {**fields, "eval/time_s": time.perf_counter() - started}
        if isinstance(first, UnpairedExample) and self.objective is not None:  # `zerofit.loop.unpaired`
            units: Any = self.examples
            args = (self.micro_batch_size, self.pad_id, self.cross_entropy)
            fields = kto_evaluation(self.strategy, self.model, units, self.objective, *args)
            return {**fields, "eval/time_s": time.perf_counter() - started}
        if isinstance(first, PreferencePair) and self.objective is not None:
            pairs: list[Any] = self.examples
            fields = preference_evaluation(
                self.strategy,
                self.model,
                pairs,
                self.objective,
                self.micro_batch_size,
                self.pad_id,
                self.cross_entropy,
            )
            return {**fields, "eval/time_s": time.perf_counter() - started}
        examples: list[Any] = self.examples
        result = evaluation_loss(
            self.strategy, self.model, examples, self.micro_batch_size, self.pad_id, self.cross_entropy
        )
        return {
            EVAL_LOSS: result.loss,
            "eval/tokens": result.tokens,
            "eval/time_s": time.perf_counter() - started,
        }
