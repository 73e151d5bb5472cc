"""Log-probabilities shared by the slices that compare a policy with a reference (pairwise, KTO, GRPO):
per-row sums of the per-token losses, and the reference as the base with its LoRA adapters off."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = ["adapters_disabled", "row_logps"]


def row_logps(token_nll: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its valid label tokens, and how many there are (fp32).

    `token_nll` is `forward_token_losses`' [rows, seq] (0 where nothing is predicted), so the sum is a
    plain reduction; the count is of labels 1.. (position 0 predicts nothing), as `count_label_tokens`.
    """
    counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).to(token_nll.device, torch.float32)
    return -token_nll.sum(dim=1), counts


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
