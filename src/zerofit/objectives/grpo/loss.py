"""GRPO and its published variants as a train-step objective: one exact loss whatever the split.

A GRPO global batch is G x `rl.prompts_per_step` completions (`zerofit.loop.rollout` samples and scores
them); every completion carries its advantage, computed from its WHOLE group before the step
(`group_advantages`, TRL's definition):

    A_i = r_i - mean(group)                      scale_rewards = none (Dr. GRPO)
    A_i = (r_i - mean(group)) / (std + 1e-4)     std of the group (GRPO) or of the whole batch; Bessel's
                                                 correction, as TRL's `nanstd`

Per completion token t, with pi the policy's log-prob at the sampling temperature, pi_old the rollout
policy's (`old_logps`, kept when `rl.num_iterations` > 1; else the detached current one, so the ratio is 1
with the ratio's gradient) and pi_ref the reference's (the base with the adapters off):

    ratio = exp(pi - pi_old)                                   rl.importance_sampling_level = token
    l_t   = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta k3 w,
    k3    = exp(pi_ref - pi) - (pi_ref - pi) - 1                    (only when beta > 0)
    w     = ratio (rl.use_bias_correction_kl, TRL's default)  or  1 (the original GRPO, DeepSeekMath)

TRL's `use_bias_correction_kl` (DeepSeek-V3.2) weights k3 by the (differentiable) ratio, which makes its
gradient the unbiased reverse-KL gradient and changes it even on-policy, where the ratio's value is 1.
GSPO (Zheng et al. 2025) replaces the token ratio by the sequence's: the geometric mean of its token ratios,

    ratio_i = exp(sum_t (pi - pi_old) / |o_i|)                 rl.importance_sampling_level = sequence
    ratio_t = sg[ratio_i] x exp(pi - sg[pi])                   sequence_token (GSPO-token)

clipped as one number per completion; GSPO-token has sequence's value and a per-token gradient, so a
per-token advantage could weight each token (with GRPO's per-completion advantages its gradient is GSPO's).

and the three loss types differ only in what the token losses are normalized by:

    grpo     sum_i (sum_t l_t / |o_i|) / N           each completion's token mean, the mean over completions
    dapo     sum_i sum_t l_t / sum_i |o_i|           the token mean over the global batch
    dr_grpo  sum_i sum_t l_t / (N x L)               L = rl.max_completion_length

Each normalizer (N completions, the global completion tokens, N x L) is a `count` of the objective, all-reduced
once per global batch before any backward by `zerofit.loop.train.train_step`; each micro-batch contributes only
sums, so the loss and its gradient are the same for every micro x accumulation x data-parallel split. (TRL
normalizes grpo and dr_grpo per micro-batch and divides by the accumulation steps, the same only when every
micro-batch has as many completions, which zerofit's batch rule guarantees; its dapo divides by the global
token count, as here.) With `rl.mask_truncated_completions` a truncated completion has no loss tokens but
still counts in N (TRL's: its row mean is 0).

A GRPO micro-batch (`zerofit.loop.rollout.micro_batch`): `input_ids` [rows, prompt + completion] (prompts
left-padded, completions right-padded), `attention_mask`, `position_ids` (from the mask, so a row's values
never depend on its neighbours' padding), `labels` (the completion tokens that are trained on, IGNORE_INDEX
elsewhere), `advantages` [rows], and with `num_iterations` > 1 `old_logps` [rows, seq] in the shifted frame
of `zerofit.token_loss.sums.token_losses` (position t holds token t + 1's).

The metrics are token means over the global batch's trained tokens, TRL's: `kl` (k3, with beta > 0) and
`clip_ratio` (the tokens whose ratio was clipped in the direction that stops the gradient: below 1 - epsilon
with A < 0, above 1 + epsilon_high with A > 0; at the sequence levels a completion's tokens share its flag, so
this is the token-weighted share, where TRL's counts completions). `kl` is the k3 term as the loss adds it
(times the ratio with the bias correction), TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofit.objectives.logps import adapters_disabled
from zerofit.objectives.protocol import Batch, UnitMeans
from zerofit.token_loss.fused import FUSED_LINEAR, forward_token_losses
from zerofit.token_loss.sums import IGNORE_INDEX, shifted_targets, token_losses

__all__ = [
    "ADVANTAGE_EPS",
    "VISION_PREFIX",
    "GRPOObjective",
    "GRPOSettings",
    "group_advantages",
    "grpo_inputs",
    "importance_log_ratio",
    "policy_logps",
    "token_loss",
    "trained_mask",
]

ADVANTAGE_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)
VISION_PREFIX = "images/"  # a micro-batch's image inputs (a vision-language rollout's), by the model's names
METRICS = ("kl", "clip_ratio")


@dataclass(frozen=True)
class GRPOSettings:
    """The `rl` section as the loss reads it."""

    loss_type: str = "dapo"  # grpo | dapo | dr_grpo
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    max_completion_length: int = 128
    temperature: float = 1.0
    use_bias_correction_kl: bool = True  # TRL's default; False: the original GRPO's k3
    importance_sampling_level: str = "token"  # token | sequence (GSPO) | sequence_token (GSPO-token)

    @property
    def upper(self) -> float:
        """The ratio's upper clipping bound, 1 + epsilon_high (epsilon when unset)."""
        return 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str) -> torch.Tensor:
    """Each completion's advantage from its whole group (`rewards` [N], groups contiguous), TRL's definition:
    reward minus its group's mean, divided by the group's (or the batch's) std + 1e-4 unless `scale` is none."""
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    elif scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        raise ValueError(f"rl.scale_rewards {scale!r}: expected group, batch or none")
    return centred / (std + ADVANTAGE_EPS)


def trained_mask(batch: Batch) -> torch.Tensor:
    """[rows, seq] bool in the shifted frame: position t predicts a trained completion token."""
    labels = batch["labels"]
    return (shifted_targets(labels).reshape(labels.shape) != IGNORE_INDEX).to(labels.device)


def grpo_inputs(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's keyword arguments: ids, the padding mask and positions counted over real tokens only; a
    vision-language rollout's image inputs (its `VISION_PREFIX` keys, without positions: the model computes
    its M-RoPE grid from the mask and the token types, `zerofit.loop.vision_rollout`)."""
    text = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    images = {
        k.removeprefix(VISION_PREFIX): v.to(device) for k, v in batch.items() if k.startswith(VISION_PREFIX)
    }
    return {**text, **images}


def policy_logps(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    impl: str,
    temperature: float,
) -> torch.Tensor:
    """Per-token log-probs of `labels` under softmax(logits / temperature), [rows, seq] fp32, shifted frame
    (0 where nothing is trained). Temperature 1 goes through the loss implementation as SFT's does
    (`fused_linear` included); another temperature scales the logits first (TRL's logps), which resolve
    refuses with `fused_linear`."""
    if temperature == 1.0:
        return -forward_token_losses(model, inputs, labels, impl)
    if impl == FUSED_LINEAR:
        raise ValueError("rl.temperature != 1 with train.cross_entropy = fused_linear")
    logits = model(**inputs, use_cache=False).logits
    return -token_losses(logits / temperature, labels, impl)


def importance_log_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log of the importance ratio, [rows, seq] (token, sequence_token) or [rows, 1] (sequence): the token's,
    or its completion's mean over the trained tokens `mask` (GSPO: the log of the geometric mean)."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    sequence = (log_ratio.where(mask, 0.0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).unsqueeze(1)
    if level == "sequence":
        return sequence
    if level == "sequence_token":
        return logps - logps.detach() + sequence.detach()
    raise ValueError(f"rl.importance_sampling_level {level!r}: expected token, sequence or sequence_token")


def token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    ref_logps: torch.Tensor | None,
    s: GRPOSettings,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (+ beta k3, times the ratio with the bias correction), the k3 term as the
    loss adds it (zeros without a reference) and the clipped flags, all [rows, seq] (module docstring);
    `mask` is the trained tokens (the sequence levels' mean)."""
    ratio = torch.exp(importance_log_ratio(logps, old_logps, mask, s.importance_sampling_level))
    a = advantages.unsqueeze(1)
    clipped_ratio = torch.clamp(ratio, 1 - s.epsilon, s.upper)
    loss = -torch.min(ratio * a, clipped_ratio * a)
    loss = loss.expand_as(logps)
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        if s.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + s.beta * kl
    clipped = ((ratio < 1 - s.epsilon) & (a < 0)) | ((ratio > s.upper) & (a > 0))
    return loss, kl.detach(), clipped.expand_as(logps)


class GRPOObjective(UnitMeans):
    """The GRPO / DAPO / Dr. GRPO loss on rollout micro-batches (module docstring)."""

    metrics: tuple[str, ...] = METRICS

    def __init__(self, settings: GRPOSettings) -> None:
        self.s = settings

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """This rank's normalizer for the loss type, then its trained tokens (the metrics' denominator)."""
        tokens = sum(int(trained_mask(b).sum()) for b in micro_batches)
        completions = sum(int(b["input_ids"].size(0)) for b in micro_batches)
        if self.s.loss_type == "grpo":
            return [completions, tokens]
        if self.s.loss_type == "dr_grpo":
            return [completions * self.s.max_completion_length, tokens]
        if self.s.loss_type == "dapo":
            return [tokens]
        raise ValueError(f"rl.loss_type {self.s.loss_type!r}: expected grpo, dapo or dr_grpo")

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The micro-batch's loss sum for its normalizer (and a zero for the token count, grpo / dr_grpo) and
        the detached token sums of `METRICS`."""
        device = inputs["input_ids"].device
        inputs = grpo_inputs(batch, device)
        labels = batch["labels"]
        ref = None
        if self.s.beta > 0:
            with torch.no_grad(), adapters_disabled(model):
                ref = policy_logps(model, inputs, labels, impl, self.s.temperature)
        logps = policy_logps(model, inputs, labels, impl, self.s.temperature)
        old = batch["old_logps"].to(device) if "old_logps" in batch else logps.detach()
        advantages = batch["advantages"].to(device, torch.float32)
        mask = trained_mask(batch).to(device)
        loss, kl, clipped = token_loss(logps, old, advantages, ref, self.s, mask)
        per_token = loss.where(mask, 0.0)
        if self.s.loss_type == "grpo":
            rows = mask.sum(dim=1).clamp(min=1)
            terms = [(per_token.sum(dim=1) / rows).sum(), per_token.sum() * 0.0]
        elif self.s.loss_type == "dr_grpo":
            terms = [per_token.sum(), per_token.sum() * 0.0]
        else:
            terms = [per_token.sum()]
        sums = torch.stack([kl.where(mask, 0.0).sum(), clipped.where(mask, False).sum()]).double()
        return terms, sums
