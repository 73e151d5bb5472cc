"""`train.objective: reward`: a reward model's Bradley-Terry loss on preference pairs (TRL's RewardTrainer).

The model is a one-output sequence classifier (`zerofit.models.heads`): one forward of a micro-batch's 2m
rows (`zerofit.data.pairs.collate_pairs`: chosen rows, then rejected) gives one scalar reward per row, read
at its last non-pad token. Per pair, with r_c, r_r the chosen and rejected rewards, mu the record's optional
`margin` (0 without one) and c `reward.center_rewards_coefficient` (0 when unset):

    loss = -log sigmoid(r_c - r_r - mu) + c (r_c + r_r)^2

normalized by the GLOBAL batch's pairs (the objective's one count, all-reduced before any backward by
`zerofit.loop.train.train_step`), so the loss and its gradient are the same whatever the split. TRL's
`compute_loss` takes the same two means over its batch's pairs (-logsig(...).mean() + c * mean(...^2)):
equal at one micro-batch per step on one process; TRL's gradient accumulation averages per-micro-batch
means instead, which differs on ragged windows (the unit tests show both).

Metrics (per-pair means over the global batch, the names DPO's rows use so `zerofit compare` shows them):
`rewards/chosen`, `rewards/rejected`, `rewards/accuracies` (r_c > r_r: TRL's RewardTrainer `accuracy`),
`rewards/margins` (r_c - r_r: TRL's `margin`).

A packed micro-batch (`batch.tokens_per_micro_batch`: the 2m sequences as segments of rows, numbered by
`sequence_ids` as the padded rows are) cannot use transformers' pooling, which reads one last token per row:
the score head's per-token output is taken as it leaves the head (a forward hook on `SCORE_HEAD`) and read
at each segment's last token, the same numbers the padded rows' pooling reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from zerofit.objectives.protocol import Batch, UnitMeans
from zerofit.objectives.reward_model.head import SCORE_HEAD

__all__ = ["REWARD_METRICS", "RewardObjective", "pair_rewards", "reward_losses"]

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def reward_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coefficient: float | None = None,
) -> torch.Tensor:
    """Per pair: -log sigmoid(r_c - r_r - margin), plus c (r_c + r_r)^2 with a centering coefficient c."""
    diff = chosen - rejected if margin is None else chosen - rejected - margin
    losses = -F.logsigmoid(diff)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def pair_rewards(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], ids: torch.Tensor | None = None
) -> torch.Tensor:
    """One fp32 reward per row: the sequence classifier's one output (`num_labels=1`), at its last
    non-pad token (transformers' pooling by `config.pad_token_id`); with a packed micro-batch's `ids`
    (`sequence_ids`), one per numbered sequence, at its last token (module docstring)."""
    if ids is None:
        return model(**inputs, use_cache=False).logits.squeeze(-1).float()
    with _token_scores(model) as seen:
        pooled = model(**inputs, use_cache=False).logits
    scores = seen[-1].squeeze(-1).float().reshape(-1)
    # The model's own output joins the graph, times zero: FSDP2 gathers the root's parameters for backward
    # from a hook on the root's outputs, which a loss on the head's inner output alone would never fire.
    return scores[_last_tokens(ids).to(scores.device)] + pooled.float().sum() * 0.0


_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


@contextmanager
def _token_scores(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The score head's per-token outputs of the forwards run inside (the outermost module named
    `SCORE_HEAD`: peft's wrapper of it under LoRA, whose output is the trained head's)."""
    head = _HEADS.get(model)
    if head is None:  # found once per model, not by a module walk at every micro-step
        head = next(m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == SCORE_HEAD)
        _HEADS[model] = head
    seen: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _args, out: seen.append(out))
    try:
        yield seen
    finally:
        handle.remove()


def _last_tokens(ids: torch.Tensor) -> torch.Tensor:
    """The flat index of each numbered sequence's last token in a packed micro-batch's `sequence_ids`."""
    flat = ids.reshape(-1)
    keep = flat >= 0
    where = torch.arange(flat.numel())
    last = torch.zeros(int(flat.max()) + 1, dtype=torch.long)
    return last.scatter_reduce(0, flat[keep], where[keep], "amax")


class RewardObjective(UnitMeans):
    """The Bradley-Terry reward-model loss on `collate_pairs` micro-batches (module docstring)."""

    metrics: tuple[str, ...] = REWARD_METRICS

    def __init__(self, center_rewards_coefficient: float | None = None) -> None:
        self.center = center_rewards_coefficient

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """Pairs of this rank's micro-batches."""
        return [sum(int(b["pairs"]) for b in micro_batches)]

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One forward of the 2m rows: the loss sum over the m pairs and the detached per-pair metric sums
        (`REWARD_METRICS`, fp64). `impl` (train.cross_entropy) is unused: no loss over a vocabulary."""
        rewards = pair_rewards(model, inputs, batch.get("sequence_ids"))
        m = int(batch["pairs"])
        if m == 0:  # an empty micro-batch's dummy row: zero loss that still carries the graph
            zero = rewards.sum() * 0.0
            return [zero], zero.new_zeros(len(REWARD_METRICS), dtype=torch.float64)
        chosen, rejected = rewards[:m], rewards[m:]
        margin = batch.get("margin")
        margin = margin.to(rewards.device, torch.float32) if margin is not None else None
        losses = reward_losses(chosen, rejected, margin, self.center)
        c, r = chosen.detach().double(), rejected.detach().double()
        sums = torch.stack([c.sum(), r.sum(), (c > r).double().sum(), (c - r).sum()])
        return [losses.sum()], sums
