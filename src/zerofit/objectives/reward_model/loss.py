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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerofit.objectives.protocol import Batch, UnitMeans

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


def pair_rewards(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """One fp32 reward per row: the sequence classifier's one output (`num_labels=1`), at its last
    non-pad token (transformers' pooling by `config.pad_token_id`)."""
    return model(**inputs, use_cache=False).logits.squeeze(-1).float()


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
        rewards = pair_rewards(model, inputs)
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
