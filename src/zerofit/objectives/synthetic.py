"""Synthetic max-length micro-batches for `zerofit plan --probe` (`zerofit.recipe.probe`): each slice's
`ObjectiveSpec.synthetic_batch` starts from these token rows and adds what its own loader's collation adds."""

from __future__ import annotations

from typing import Any

from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = ["token_rows"]


def token_rows(rows: int, seq: int, vocab: int, pad_id: int) -> dict[str, Any]:
    """`rows` random sequences of `seq` tokens, right-padded by one position on the last row (zerofit's
    padded batches take the masked attention path), every real token a label."""
    import torch

    ids = torch.randint(3, max(vocab, 4), (rows, seq), dtype=torch.long)
    mask = torch.ones(rows, seq, dtype=torch.long)
    if rows > 1:
        mask[-1, -1] = 0
        ids[-1, -1] = pad_id
    labels = ids.clone()
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
