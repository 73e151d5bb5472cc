"""The evaluation of unpaired units (KTO's, `train.objective: kto`): `eval/loss` and TRL's `eval/*` metrics over the held-out examples.

The whole eval set is one global batch for the reference point: each held-out example is paired with the
completion of the one before it in the eval data (the first with the last), z0 is their mean KL over every
held-out example (one all-reduce, `KTOObjective.estimate_reference_point`), then the loss is the mean
weighted KTO loss over every held-out example (one all-reduce of the sums and counts). So the numbers do not
depend on micro_batch_size or the number of ranks. (TRL's evaluation pairs and estimates z0 per eval batch.)
"""

from __future__ import annotations

from typing import Any

import torch

from zerofit.core.errors import DataError
from zerofit.data import model_inputs
from zerofit.data.unpaired import UnpairedExample, kto_micro_batches
from zerofit.metrics.keys import EVAL_LOSS
from zerofit.objectives.protocol import Objective
from zerofit.strategies.base import Strategy
from zerofit.token_loss.fused import FUSED_LINEAR

__all__ = ["kto_evaluation"]


def kto_evaluation(
    strategy: Strategy,
    model: torch.nn.Module,
    units: list[UnpairedExample],
    objective: Objective,
    micro_batch_size: int,
    pad_id: int,
    cross_entropy: str = "chunked",
) -> dict[str, Any]:
    """`eval/loss`, `eval/examples` and `eval/<metric>` over every example of `units` (collective)."""
    impl = FUSED_LINEAR if cross_entropy == FUSED_LINEAR else "chunked"
    dp, rank = strategy.dp_world_size, strategy.dp_rank
    windows = max(-(-len(units) // (micro_batch_size * dp)), 1)
    batches = kto_micro_batches(units, list(range(len(units))), micro_batch_size, windows, dp, rank, pad_id)
    was_training = model.training
    model.eval()
    sums = torch.zeros(1 + len(objective.metrics), dtype=torch.float64, device=strategy.device)
    try:
        objective.before_window(strategy, model, batches, impl)  # z0 over every held-out example
        with torch.no_grad():
            for batch in batches:
                with strategy.accumulate(is_last=True):  # the training forward's context, nothing deferred
                    terms, metric_sums = objective.terms(
                        model, model_inputs(batch, strategy.device), batch, impl
                    )
                sums += torch.cat([terms[0].double().reshape(1), metric_sums])
    finally:
        model.train(was_training)
    examples = float(sum(objective.counts(batches)))
    total = strategy.all_reduce_sum(torch.cat([sums, sums.new_tensor([examples])])).tolist()
    if total[-1] == 0:  # the same on every rank: every rank raises (the loader refuses such data first)
        raise DataError(
            "the evaluation data (data.eval_path or data.eval_split) holds no examples to score, so eval/loss "
            "would be a mean over nothing; use a larger data.eval_split or another data.eval_path."
        )
    metrics = objective.metric_means(total[1:-1], int(total[-1]), prefix="eval/")
    return {EVAL_LOSS: total[0] / total[-1], "eval/examples": int(total[-1]), **metrics}
