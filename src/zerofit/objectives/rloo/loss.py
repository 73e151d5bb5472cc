"""RLOO (Ahmadian et al. 2024) as TRL 1.16's RLOOTrainer defines it: one exact loss whatever the split.

The rollout is GRPO's (`zerofit.loop.rollout`: G completions per prompt, the rewards of the whole global
batch on every rank); the advantage of completion i is its reward minus the mean of its group's OTHER G - 1
rewards (the leave-one-out baseline), optionally normalized over the global batch (`rl.normalize_advantages`,
mean 0 and std + 1e-4 with Bessel's correction, TRL's `nanstd`):

    A_i = r_i - (sum_j r_j - r_i) / (G - 1)

The ratio is the completion's, of its SUMMED log-probs (TRL's RLOO: not GSPO's mean), clipped as GRPO's:

    ratio_i = exp(sum_t (pi - pi_old))
    l_i     = -min(ratio_i A_i, clip(ratio_i, 1 - epsilon, 1 + epsilon_high) A_i)
    loss    = sum_i l_i / N                  N: the global batch's completions (TRL: its mean per micro-batch,
                                             divided by the accumulation steps: the same, every micro-batch
                                             holding as many completions)

With pi_old the rollout policy's (`old_logps`, kept when `rl.num_iterations` > 1; else the detached current
one: ratio 1 with the ratio's gradient). A completion with no trained tokens (`rl.mask_truncated_completions`)
has ratio 1 and no gradient, and still counts in N (TRL's). The metric `clip_ratio` is the share of the global
batch's completions whose ratio was clipped in the direction that stops the gradient (TRL's region).

With `rl.beta` > 0 each reward first loses beta x its completion's summed k1 to the reference (TRL's RLOO,
after the paper: a KL penalty in the reward, not a loss term), by the rollout policy before any update:

    r_i <- r_i - beta x sum_t (pi_old - pi_ref)      pi_ref: the base with the LoRA adapters off (before A_i)

(`kl_penalty`, every rank's completions all-reduced before the advantages; the metric `kl` is the token mean
of pi_old - pi_ref over the global batch, TRL's; `reward` stays the reward functions' own).
"""

from __future__ import annotations

import torch

from zerofit.objectives.grpo.loss import (
    ADVANTAGE_EPS,
    GRPOSettings,
    grpo_inputs,
    policy_logps,
    trained_mask,
)
from zerofit.objectives.logps import adapters_disabled
from zerofit.objectives.protocol import Batch, Reducing, UnitMeans

__all__ = ["RLOOObjective", "kl_penalty", "leave_one_out_advantages", "sequence_loss"]


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int, normalize: bool) -> torch.Tensor:
    """Each completion's reward minus its group's other rewards' mean (`rewards` [N], groups contiguous),
    then, with `normalize`, standardized over the whole batch (TRL's RLOO advantages)."""
    grouped = rewards.view(-1, group_size)
    baselines = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = (grouped - baselines).reshape(-1)
    if normalize:
        advantages = (advantages - advantages.mean()) / (advantages.std() + ADVANTAGE_EPS)
    return advantages


def kl_penalty(
    strategy: Reducing,
    model: torch.nn.Module,
    batches: list[Batch],
    indices: list[list[int]],
    total: int,
    s: GRPOSettings,
    impl: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """beta x each completion's summed pi_old - pi_ref, [total] on every rank (this rank's `batches` hold the
    global completions `indices`), and the metric `kl`: that log-ratio's token mean over the global batch."""
    local = torch.zeros(total + 2, dtype=torch.float64, device=strategy.device)  # the sums, then kl's two
    for batch, micro in zip(batches, indices, strict=True):
        inputs = grpo_inputs(batch, strategy.device)
        labels = batch["labels"]
        with torch.no_grad():
            if "old_logps" in batch:
                old = batch["old_logps"].to(strategy.device)
            else:
                old = policy_logps(model, inputs, labels, impl, s.temperature)
            with adapters_disabled(model):
                ref = policy_logps(model, inputs, labels, impl, s.temperature)
        mask = trained_mask(batch).to(strategy.device)
        sums = (old - ref).where(mask, 0.0).sum(dim=1).double()
        local[torch.tensor(micro, device=strategy.device)] = sums
        local[total] += sums.sum()
        local[total + 1] += mask.sum()
    reduced = strategy.all_reduce_sum(local).cpu()
    kl = float(reduced[total] / reduced[total + 1].clamp(min=1))
    return s.beta * reduced[:total], {"kl": kl}


def sequence_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    s: GRPOSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion clipped surrogate of the summed log-probs' ratio and its clipped flags, both [rows]
    (`logps`, `old_logps`, `mask` [rows, seq]: the trained tokens)."""
    ratio = torch.exp(logps.where(mask, 0.0).sum(dim=1) - old_logps.where(mask, 0.0).sum(dim=1))
    clipped_ratio = torch.clamp(ratio, 1 - s.epsilon, s.upper)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1 - s.epsilon) & (advantages < 0)) | ((ratio > s.upper) & (advantages > 0))
    return loss, clipped


class RLOOObjective(UnitMeans):
    """The RLOO loss on rollout micro-batches (module docstring); `settings` reads epsilon, epsilon_high and
    the temperature."""

    metrics: tuple[str, ...] = ("clip_ratio",)

    def __init__(self, settings: GRPOSettings) -> None:
        self.s = settings

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """This rank's completions (the loss's normalizer and the metric's denominator)."""
        return [sum(int(b["input_ids"].size(0)) for b in micro_batches)]

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The micro-batch's summed per-completion losses and its clipped completions."""
        device = inputs["input_ids"].device
        inputs = grpo_inputs(batch, device)
        logps = policy_logps(model, inputs, batch["labels"], impl, self.s.temperature)
        old = batch["old_logps"].to(device) if "old_logps" in batch else logps.detach()
        advantages = batch["advantages"].to(device, torch.float32)
        loss, clipped = sequence_loss(logps, old, advantages, trained_mask(batch).to(device), self.s)
        return [loss.sum()], clipped.sum().double().reshape(1)
