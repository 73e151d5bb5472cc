"""SFT's loss: next-token cross-entropy on the responses, one token sum per micro-batch, normalized by the
global batch's valid label tokens (`zerofit.token_loss`: chunked, unchunked, Liger, or fused in lm_head)."""

from __future__ import annotations

import torch

from zerofit.objectives.protocol import Batch, UnitMeans
from zerofit.token_loss.fused import forward_token_sum
from zerofit.token_loss.sums import batch_labels, count_label_tokens

__all__ = ["SFTObjective"]


class SFTObjective(UnitMeans):
    """Next-token loss on the responses: one token sum per micro-batch over the global valid tokens."""

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """Valid label tokens of this rank's micro-batches."""
        return [sum(count_label_tokens(*batch_labels(b)) for b in micro_batches)]

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The micro-batch's token-loss sum (`zerofit.token_loss.fused.forward_token_sum`); no metrics."""
        labels, shifted = batch_labels(batch)  # a sequence-parallel shard's are shifted already
        loss_sum = forward_token_sum(model, inputs, labels, impl, shifted)
        return [loss_sum], loss_sum.new_zeros(0, dtype=torch.float64)
