"""Preference pairs as the loop sees them (`train.objective` dpo / simpo / orpo): one unit of the global batch.

A pair is two tokenized sequences with the same prompt, `chosen` and `rejected`, each an `Example` whose
labels are IGNORE_INDEX on the prompt (and bos): the loss reads only the response tokens. The sampler and
the batch split count pairs, never sequences, so a pair can never be split across micro-batches or ranks.

`collate_pairs` lays a micro-batch of m pairs out as one forward of 2m rows: rows 0..m-1 the chosen
sequences, rows m..2m-1 the rejected ones, in the same pair order (the concatenated forward of TRL and
torchtune), right-padded to the longest of all 2m.

Under a token budget (`batch.tokens_per_micro_batch`) `pair_micro_batches` packs instead: a micro-batch is
at most tokens / max_seq_len rows of max_seq_len tokens, each chosen and each rejected sequence a segment of
a row (position ids restarting per segment, `zerofit.data.packing`), both sequences of a pair in the same
micro-batch; `sequence_ids` numbers the segments as the padded layout numbers its rows (chosen k is k,
rejected k is m + k), so a loss reads per-sequence sums in the same order either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofit.data.batches import collate, split_global_batch
from zerofit.data.packing import Segment, collate_packed, packed_unit_micro_batches, units_of
from zerofit.data.sft import Example

__all__ = ["PreferencePair", "collate_packed_pairs", "collate_pairs", "pair_micro_batches"]


@dataclass
class PreferencePair:
    """One preference pair: the chosen and the rejected sequence of one prompt (see the module docstring).

    `reference` is the reference model's summed response log-probabilities (chosen, rejected) when they were
    precomputed before training (`preference.reference: precomputed`), else None. `margin` is the record's
    optional `margin` column (TRL's reward-model layout: how much the chosen should out-score the rejected),
    else None.
    """

    chosen: Example
    rejected: Example
    reference: tuple[float, float] | None = None
    margin: float | None = None

    @property
    def input_ids(self) -> list[int]:
        """Both sequences' tokens, chosen first: what the pair costs a forward (for token accounting)."""
        return self.chosen.input_ids + self.rejected.input_ids


def collate_pairs(pairs: list[PreferencePair], pad_id: int) -> dict[str, torch.Tensor]:
    """A micro-batch of pairs as 2m right-padded rows (chosen rows, then rejected rows) plus `pairs` (m).

    `reference_logps` (2m, fp64: chosen then rejected, like the rows) is included when every pair carries
    precomputed reference log-probabilities. An empty list gives `collate([])`'s single dummy row and
    `pairs` = 0: a rank with nothing left in a partial window still runs forward and backward. `margin` (m,
    fp32) is included when any pair has one (a pair without: 0, no margin).
    """
    if not pairs:
        return {**collate([], pad_id), "pairs": torch.tensor(0)}
    batch = collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    return {**batch, **_per_pair(pairs)}


def _per_pair(pairs: list[PreferencePair]) -> dict[str, torch.Tensor]:
    """`pairs` (m), and `reference_logps` / `margin` where the pairs carry them (`collate_pairs`), in the
    pairs' order."""
    out = {"pairs": torch.tensor(len(pairs))}
    if all(p.reference is not None for p in pairs):
        chosen = [p.reference[0] for p in pairs if p.reference is not None]
        rejected = [p.reference[1] for p in pairs if p.reference is not None]
        out["reference_logps"] = torch.tensor(chosen + rejected, dtype=torch.float64)
    if any(p.margin is not None for p in pairs):
        out["margin"] = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float32)
    return out


def collate_packed_pairs(
    rows: list[list[Segment]], pairs: list[PreferencePair], pad_id: int
) -> dict[str, torch.Tensor]:
    """A packed micro-batch of pairs (`rows` of (pair index, 0 chosen / 1 rejected) segments): `collate_packed`'s
    tensors with `sequence_ids` (chosen of the micro-batch's k-th pair k, its rejected m + k) and `collate_pairs`'
    per-pair ones in the same pair order. No rows: the dummy row and `pairs` = 0."""
    order = units_of(rows)
    if not order:
        return {**collate_packed([], pad_id, numbers=[]), "pairs": torch.tensor(0)}
    at, m = {unit: k for k, unit in enumerate(order)}, len(order)
    examples = [[(pairs[u].chosen, pairs[u].rejected)[side] for u, side in row] for row in rows]
    numbers = [[side * m + at[u] for u, side in row] for row in rows]
    return {**collate_packed(examples, pad_id, numbers), **_per_pair([pairs[u] for u in order])}


def pair_micro_batches(
    pairs: list[PreferencePair],
    indices: list[int],
    micro_batch_size: int,
    grad_accum_steps: int,
    dp_size: int,
    rank: int,
    pad_id: int,
    row_tokens: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """This rank's collated micro-batches of the global batch `indices`. Padded: `grad_accum_steps` micro-batches of micro_batch_size pairs.
    Packed (`row_tokens`, data.max_seq_len): micro_batch_size rows of row_tokens per micro-batch, as many
    micro-batches as the rank that needs the most (module docstring). A pair is never split either way."""
    micro, accum, dp = micro_batch_size, grad_accum_steps, dp_size
    if row_tokens is None:
        mine = split_global_batch(indices, micro, accum, dp, rank)
        return [collate_pairs([pairs[i] for i in idx], pad_id) for idx in mine]
    lengths = {i: (len(pairs[i].chosen.input_ids), len(pairs[i].rejected.input_ids)) for i in indices}
    packed = packed_unit_micro_batches(indices, lengths, micro, row_tokens, dp, rank)
    return [collate_packed_pairs(rows, pairs, pad_id) for rows in packed]
