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

__all__ = [
    "Segment",
    "collate_packed",
    "deal_to_ranks",
    "pack_rows",
    "packed_micro_batches",
    "packed_unit_micro_batches",
    "units_of",
]

# One sequence of a unit in a packed row: (the unit's index, which of its sequences: a pair's 0 chosen, 1
# rejected; an example's or unpaired example's 0).
Segment = tuple[int, int]


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


class _MicroBatch:
    """A micro-batch being filled: its rows of segments and the room left in each."""

    def __init__(self, rows_per_micro_batch: int, row_capacity: int) -> None:
        self.most, self.capacity = rows_per_micro_batch, row_capacity
        self.rows: list[list[Segment]] = []
        self.room: list[int] = []

    def place(self, unit: int, lengths: tuple[int, ...]) -> bool:
        """Place every sequence of `unit` (longest first, each in the first row with room, opening rows up to
        the micro-batch's rows) and say True, or leave the micro-batch as it was and say False."""
        room, placed = list(self.room), []
        for k in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
            at = next((r for r, free in enumerate(room) if lengths[k] <= free), None)
            if at is None:
                if len(room) == self.most:
                    return False
                room.append(self.capacity)
                at = len(room) - 1
            room[at] -= lengths[k]
            placed.append((at, (unit, k)))
        self.room = room
        self.rows += [[] for _ in range(len(room) - len(self.rows))]
        for at, segment in placed:
            self.rows[at].append(segment)
        return True


def _unit_micro_batches(
    indices: list[int], lengths: dict[int, tuple[int, ...]], rows_per_micro_batch: int, row_capacity: int
) -> list[list[list[Segment]]]:
    """One rank's units in micro-batches, first-fit-decreasing by the unit's tokens: a unit goes to the first
    micro-batch whose rows still hold all of its sequences, so a unit is never split between micro-batches. A
    new micro-batch takes at least as many rows as the unit has sequences (a pair whose two sequences share no
    row of a one-row budget gets two)."""
    batches: list[_MicroBatch] = []
    for index in sorted(indices, key=lambda i: (-sum(lengths[i]), i)):
        if max(lengths[index]) > row_capacity:
            raise ValueError(
                f"unit {index} has a sequence of {max(lengths[index])} tokens, more than a row's {row_capacity}"
            )
        if not any(batch.place(index, lengths[index]) for batch in batches):
            batches.append(_MicroBatch(max(rows_per_micro_batch, len(lengths[index])), row_capacity))
            batches[-1].place(index, lengths[index])
    return [batch.rows for batch in batches]


def packed_unit_micro_batches(
    indices: list[int],
    lengths: dict[int, tuple[int, ...]],
    rows_per_micro_batch: int,
    row_capacity: int,
    dp_size: int,
    rank: int,
) -> list[list[list[Segment]]]:
    """This rank's micro-batches of one global batch of units of one or more sequences each (a preference
    pair: its chosen and rejected; `lengths` gives each unit's sequence lengths), each micro-batch
    `rows_per_micro_batch` rows (or a unit's sequences, if more) of segments of at most `row_capacity` tokens,
    a unit's sequences all in one micro-batch. Units are dealt to ranks as examples are (`deal_to_ranks`, by their tokens); every rank gets
    the same number of micro-batches (at least one), the extra ones of a rank that needs fewer empty."""
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} outside dp_size {dp_size}")
    totals = {i: sum(lengths[i]) for i in indices}
    shares = deal_to_ranks(indices, totals, dp_size)
    by_rank = [_unit_micro_batches(share, lengths, rows_per_micro_batch, row_capacity) for share in shares]
    steps = max(1, *(len(batches) for batches in by_rank))
    return by_rank[rank] + [[] for _ in range(steps - len(by_rank[rank]))]


def units_of(rows: list[list[Segment]]) -> list[int]:
    """The units of a packed micro-batch, in the order their first sequence appears (the order its
    per-unit tensors follow)."""
    return list(dict.fromkeys(unit for row in rows for unit, _ in row))


def collate_packed(
    rows: list[list[Example]], pad_id: int, numbers: list[list[int]] | None = None
) -> dict[str, torch.Tensor]:
    """Packed rows as tensors: input_ids, labels, position_ids (restarting per example) and attention_mask
    (1 on real tokens: for counting; the model gets the position ids instead, see `model_inputs`).

    Rows are right-padded to the longest; the padding is a segment of its own (positions from 0, labels
    IGNORE_INDEX). No rows gives the dummy row of an empty `collate` (a rank with nothing left this step).
    With `numbers` (each example's number, row by row: a preference pair's chosen k is k, its rejected m + k)
    also `sequence_ids`: each token's number, -1 on the padding (the dummy token: 0, as an empty unpacked
    micro-batch's one row), which a loss gathers per-sequence sums by (`zerofit.objectives.logps`).
    """
    if not rows:
        # The model never sees this mask (packed batches pass position ids): 0 so the dummy token does not
        # count as a useful one.
        dummy = collate([], pad_id)
        zeros = torch.zeros_like(dummy["input_ids"])
        numbered = {"sequence_ids": zeros} if numbers is not None else {}
        return {**dummy, "attention_mask": zeros, "position_ids": zeros, **numbered}
    width = max(sum(len(e.input_ids) for e in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    ids = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for j, e in enumerate(row):
            n = len(e.input_ids)
            input_ids[r, start : start + n] = torch.tensor(e.input_ids, dtype=torch.long)
            labels[r, start + 1 : start + n] = torch.tensor(e.labels[1:], dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(n)
            if numbers is not None:
                ids[r, start : start + n] = numbers[r][j]
            start += n
        attention_mask[r, :start] = 1
        position_ids[r, start:] = torch.arange(width - start)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "position_ids": position_ids,
    }
    return {**batch, "sequence_ids": ids} if numbers is not None else batch
