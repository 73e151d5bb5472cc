"""Token-budget micro-batches (`batch.tokens_per_micro_batch`): whole examples packed into rows, rows into
micro-batches of about the same number of tokens.

The global batch is still the sampler's fixed set of examples (`GlobalBatchSampler`); only how it is laid
out changes, and every layout gives the same loss (a token sum over the same labels, normalized by the same
global count; docs/design.md). For one global batch:

1. ranks: the examples are dealt longest first, in snake order (rank 0, 1, ..., dp-1, dp-1, ..., 0), so
   every rank gets the same number of examples (+-1) and about the same number of tokens;
2. rows: each rank packs its examples first-fit-decreasing into rows of at most `row_capacity`
   (`data.max_seq_len`) tokens; an example is never split;
3. micro-batches: consecutive groups of `rows_per_micro_batch` rows (tokens_per_micro_batch / max_seq_len).
   Every rank runs the same number of micro-steps (the largest any rank needs, never more than
   `grad_accum_steps`); a rank with fewer runs empty (dummy) micro-batches, as in a partial window.

In a packed row the position ids restart at 0 for every example and the tail padding is its own segment,
so attention never crosses examples: transformers reads the documents off the position ids when no 2-D
attention mask is passed (`model_inputs`). Each example's first label is masked, so its first token is
never predicted from the previous example's last one (unpacked, position 0 predicts nothing either).

Pure per-rank logic, like `batches.py`: every rank computes every rank's packing from the lengths alone,
so no communication is needed to agree on the number of micro-steps.
"""

from __future__ import annotations

import math

import torch

from zerofit.data.batches import collate
from zerofit.data.sft import Example
from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = ["collate_packed", "deal_to_ranks", "pack_rows", "packed_micro_batches"]


def deal_to_ranks(indices: list[int], lengths: dict[int, int], dp_size: int) -> list[list[int]]:
    """Each rank's examples of one global batch: longest first, dealt in snake order (see the module doc)."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for k, index in enumerate(order):
        lap, pos = divmod(k, dp_size)
        shares[pos if lap % 2 == 0 else dp_size - 1 - pos].append(index)
    return shares


def pack_rows(indices: list[int], lengths: dict[int, int], row_capacity: int) -> list[list[int]]:
    """First-fit-decreasing: rows of whole examples, at most `row_capacity` tokens each."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        if n > row_capacity:
            raise ValueError(f"example {index} has {n} tokens, more than a row's {row_capacity}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(index)
                room[r] -= n
                break
        else:
            rows.append([index])
            room.append(row_capacity - n)
    return rows


def packed_micro_batches(
    indices: list[int],
    lengths: dict[int, int],
    rows_per_micro_batch: int,
    row_capacity: int,
    dp_size: int,
    rank: int,
) -> list[list[list[int]]]:
    """This rank's micro-batches of one global batch, each a list of rows of example indices.

    All ranks get the same number of micro-batches (at least one); the extra ones of a rank that needs
    fewer are empty.
    """
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} outside dp_size {dp_size}")
    rows_by_rank = [
        pack_rows(share, lengths, row_capacity) for share in deal_to_ranks(indices, lengths, dp_size)
    ]
    steps = max(1, *(math.ceil(len(rows) / rows_per_micro_batch) for rows in rows_by_rank))
    mine = rows_by_rank[rank]
    return [mine[j * rows_per_micro_batch : (j + 1) * rows_per_micro_batch] for j in range(steps)]


def collate_packed(rows: list[list[Example]], pad_id: int) -> dict[str, torch.Tensor]:
    """Packed rows as tensors: input_ids, labels, position_ids (restarting per example) and attention_mask
    (1 on real tokens: for counting; the model gets the position ids instead, see `model_inputs`).

    Rows are right-padded to the longest; the padding is a segment of its own (positions from 0, labels
    IGNORE_INDEX). No rows gives the dummy row of an empty `collate` (a rank with nothing left this step).
    """
    if not rows:
        # The model never sees this mask (packed batches pass position ids): 0 so the dummy token does not
        # count as a useful one.
        dummy = collate([], pad_id)
        return {
            **dummy,
            "attention_mask": torch.zeros_like(dummy["input_ids"]),
            "position_ids": torch.zeros_like(dummy["input_ids"]),
        }
    widths = [sum(len(e.input_ids) for e in row) for row in rows]
    width = max(widths)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for e in row:
            n = len(e.input_ids)
            input_ids[r, start : start + n] = torch.tensor(e.input_ids, dtype=torch.long)
            labels[r, start + 1 : start + n] = torch.tensor(e.labels[1:], dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(n)
            start += n
        attention_mask[r, :start] = 1
        position_ids[r, start:] = torch.arange(width - start)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "position_ids": position_ids,
    }
