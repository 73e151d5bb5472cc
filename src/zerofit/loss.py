"""The training loss as token sums: what every micro-batch contributes before the one normalization.

The loop (`zerofit.train`) divides these sums by the valid label tokens of the whole global batch; the
planner's trace (`zerofit.planner.trace`) runs the same ops to measure their memory. Labels are unshifted
(HF-style): token t's logits predict label t+1, and `IGNORE_INDEX` marks positions the loss skips
(bos, prompt tokens, padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "count_label_tokens", "token_sum_loss"]

IGNORE_INDEX = -100  # label value the loss skips (bos, prompt tokens, padding)


def count_label_tokens(labels: torch.Tensor) -> int:
    """Valid label tokens of a batch: positions 1.. whose label is not IGNORE_INDEX (position 0 predicts
    nothing)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def token_sum_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over valid labels, in fp32.

    A batch with no valid label gives a zero sum that still carries a graph, so every rank runs the same
    backward. The count that normalizes it is `count_label_tokens`, taken once per window on the host (no
    device sync per micro-step).
    """
    shift_logits = logits[:, :-1, :].float().reshape(-1, logits.size(-1))
    shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
