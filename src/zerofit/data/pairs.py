"""Preference pairs as the loop sees them (`train.objective` dpo / simpo / orpo): one unit of the global batch.

A pair is two tokenized sequences with the same prompt, `chosen` and `rejected`, each an `Example` whose
labels are IGNORE_INDEX on the prompt (and bos): the loss reads only the response tokens. The sampler and
the batch split count pairs, never sequences, so a pair can never be split across micro-batches or ranks.

`collate_pairs` lays a micro-batch of m pairs out as one forward of 2m rows: rows 0..m-1 the chosen
sequences, rows m..2m-1 the rejected ones, in the same pair order (the concatenated forward of TRL and
torchtune), right-padded to the longest of all 2m.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofit.data.batches import collate
from zerofit.data.sft import Example

__all__ = ["PreferencePair", "collate_pairs"]


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
    batch["pairs"] = torch.tensor(len(pairs))
    if all(p.reference is not None for p in pairs):
        chosen = [p.reference[0] for p in pairs if p.reference is not None]
        rejected = [p.reference[1] for p in pairs if p.reference is not None]
        batch["reference_logps"] = torch.tensor(chosen + rejected, dtype=torch.float64)
    if any(p.margin is not None for p in pairs):
        batch["margin"] = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float32)
    return batch
