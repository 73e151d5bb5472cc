"""Global batches: which examples form global batch `step`, how it is split over ranks and micro-steps,
and how a micro-batch is collated into tensors.

The order of global batches depends only on the seed and the data, never on how a global batch is split
into micro-batches x accumulation steps x data-parallel ranks: a global batch is a fixed slice of a seeded
permutation (`GlobalBatchSampler`), and only then divided among ranks and micro-steps
(`split_global_batch`). That is what makes runs with different splits comparable step by step.

No torch.distributed here: the strategy owns communication; this module is pure per-rank logic.
"""

from __future__ import annotations

import random
from typing import Literal

import torch

from zerofit.core.errors import DataError
from zerofit.data.sft import Example
from zerofit.data.vision import IMAGE_INPUTS, collate_images
from zerofit.token_loss.sums import IGNORE_INDEX


class GlobalBatchSampler:
    """Which examples form global batch number `step`: a pure function of (seed, data size, step).

    Each epoch is its own seeded permutation; it yields floor(n / gbs) full global batches, then its
    remainder is either dropped (`partial_window="drop"`) or yielded as one short batch ("normalize").
    A remainder never leaks into the next epoch. Because `batch_indices(step)` depends on nothing else,
    resuming at step k needs no sampler state.
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
        partial_window: Literal["drop", "normalize"] = "drop",
    ) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if partial_window not in ("drop", "normalize"):
            raise ValueError(f"partial_window must be 'drop' or 'normalize', got {partial_window!r}")
        if num_examples < 1:
            raise DataError("the dataset has no examples; add prompt/response lines to data.path.")
        if num_examples < global_batch_size and partial_window == "drop":
            raise DataError(
                f"the dataset has {num_examples} examples, fewer than batch.global_batch_size = "
                f"{global_batch_size}, so not one full global batch can be formed and "
                "train.partial_window = 'drop' would drop them all; add data, lower "
                "batch.global_batch_size, or set train.partial_window=normalize."
            )
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.partial_window = partial_window
        self.full_batches_per_epoch = num_examples // global_batch_size
        self.remainder = num_examples % global_batch_size
        has_partial = partial_window == "normalize" and self.remainder > 0
        self.steps_per_epoch: int = self.full_batches_per_epoch + int(has_partial)
        self._cached: tuple[int, tuple[int, ...]] | None = None  # (epoch, permutation) of the last lookup

    def _permutation(self, epoch: int) -> tuple[int, ...]:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        order = list(range(self.num_examples))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by `random.Random`: identical in every process and
            # Python version, and (unlike seed + epoch) seed s epoch 1 never equals seed s+1 epoch 0.
            random.Random(f"zerofit-sampler:{self.seed}:{epoch}").shuffle(order)
        self._cached = (epoch, tuple(order))
        return self._cached[1]

    def epoch_of(self, step: int) -> int:
        """The epoch (0-based) that global batch `step` belongs to."""
        return step // self.steps_per_epoch

    def is_partial(self, step: int) -> bool:
        """True for the short remainder batch that ends an epoch under `partial_window="normalize"`."""
        return step % self.steps_per_epoch == self.full_batches_per_epoch

    def batch_indices(self, step: int) -> list[int]:
        """Example indices of global batch `step` (0-based); full batches have exactly global_batch_size."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        k = step % self.steps_per_epoch
        start = k * self.global_batch_size
        stop = min(start + self.global_batch_size, self.num_examples)
        return list(self._permutation(self.epoch_of(step))[start:stop])


def split_global_batch(
    indices: list[int], micro_batch_size: int, grad_accum_steps: int, dp_size: int, rank: int
) -> list[list[int]]:
    """This rank's micro-batches of one global batch: exactly `grad_accum_steps` lists.

    Micro-step j of rank r gets indices[(j*dp + r)*mbs : (j*dp + r + 1)*mbs]. For a short (partial) global
    batch the tail lists are shorter or empty, but every rank still gets `grad_accum_steps` entries so the
    collectives of every micro-step stay matched across ranks.
    """
    capacity = micro_batch_size * grad_accum_steps * dp_size
    if len(indices) > capacity:
        raise ValueError(
            f"{len(indices)} indices exceed micro {micro_batch_size} x GAS {grad_accum_steps} x dp {dp_size}"
        )
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} outside dp_size {dp_size}")
    out = []
    for j in range(grad_accum_steps):
        start = (j * dp_size + rank) * micro_batch_size
        out.append(list(indices[start : start + micro_batch_size]))
    return out


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its longest example: input_ids, attention_mask, labels (IGNORE_INDEX on padding).

    An empty list gives one dummy row (a pad token, attention 1, label IGNORE_INDEX): a rank with nothing left in a
    partial window still runs forward/backward, contributing zero tokens and zero loss, so collectives and
    engine hooks stay matched across ranks.
    """
    if not examples:
        return {
            "input_ids": torch.tensor([[pad_id]], dtype=torch.long),
            "attention_mask": torch.ones(1, 1, dtype=torch.long),
            "labels": torch.full((1, 1), IGNORE_INDEX, dtype=torch.long),
        }
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e.labels, dtype=torch.long)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return {**batch, **collate_images(examples, width)}  # a vision example's image tensors (`data.vision`)


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for a collated micro-batch, on `device`.

    A padded batch (`collate`) passes its attention mask. A packed batch (`zerofit.data.packing`) passes
    its position ids and no mask: transformers then keeps attention within each document (it reads the
    documents off the restarting position ids, which it only does when no 2-D mask is given and no KV cache
    exists: call the model with `use_cache=False`, as `train_step` does).
    """
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device)}
    images = {k: v.to(device) for k, v in batch.items() if k in IMAGE_INPUTS}  # vision models' images
    return {
        "input_ids": batch["input_ids"].to(device),
        "attention_mask": batch["attention_mask"].to(device),
        **images,
    }
