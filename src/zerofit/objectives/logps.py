"""Log-probabilities shared by the slices that compare a policy with a reference (pairwise, KTO, GRPO):
per-sequence sums of the per-token losses, and the reference as the base with its LoRA adapters off.

A micro-batch is padded (one sequence per row) or packed (`batch.tokens_per_micro_batch`: sequences are
segments of rows, numbered by the batch's `sequence_ids`, `zerofit.data.packing`); `sequence_logps` gives the
same per-sequence sums, in the same order, for both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = ["adapters_disabled", "row_logps", "sequence_logps", "sequence_sums"]


def row_logps(token_nll: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its valid label tokens, and how many there are (fp32).

    `token_nll` is `forward_token_losses`' [rows, seq] (0 where nothing is predicted), so the sum is a
    plain reduction; the count is of labels 1.. (position 0 predicts nothing), as `count_label_tokens`.
    """
    counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).to(token_nll.device, torch.float32)
    return -token_nll.sum(dim=1), counts


def sequence_sums(values: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """Per sequence, the sum of a [rows, seq] per-token tensor: per row without `ids`, else per
    `sequence_ids` number (0..n-1 in order; -1, the padding, dropped)."""
    if ids is None:
        return values.sum(dim=1)
    n = int(ids.max()) + 1  # `ids` is the batch's host tensor: no device sync
    ids = ids.to(values.device)
    slots = torch.where(ids < 0, torch.full_like(ids, n), ids).reshape(-1)
    return values.new_zeros(n + 1).index_add(0, slots, values.reshape(-1))[:n]


def sequence_logps(
    token_nll: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_logps` per sequence: per row of a padded micro-batch (`ids` None), per `sequence_ids` number of
    a packed one. Position t's loss (of label t + 1) counts for t's sequence: a segment's first label is
    masked in a packed row, so no loss crosses two sequences."""
    if ids is None:
        return row_logps(token_nll, labels)
    valid = (labels != IGNORE_INDEX).to(token_nll.device, torch.float32)
    return -sequence_sums(token_nll, ids), sequence_sums(valid, ids)


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The PeftModel inside `model` (DeepSpeed's `.module`, DDP's `.module`, FSDP2's module itself) with
    its adapters switched off: the frozen base, with no second copy of it."""
    from peft import PeftModel

    peft_model = next((m for m in model.modules() if isinstance(m, PeftModel)), None)
    if peft_model is None:
        raise ValueError(
            "the reference is the base with the LoRA adapters off, and this model has no adapters"
        )
    with peft_model.disable_adapter():
        yield
