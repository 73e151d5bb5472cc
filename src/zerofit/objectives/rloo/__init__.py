"""RLOO (`train.objective: rloo`, the `rl` section): GRPO's online RL with the leave-one-out baseline and
TRL's RLOOTrainer loss.

A slice of its own, as TRL has an RLOOTrainer beside its GRPOTrainer, because RLOO changes the estimator, not
a normalizer: its advantage is the leave-one-out baseline (`rl.normalize_advantages`, not
`rl.scale_rewards`), its ratio the completion's summed log-probs, and it has no loss types, token-level
ratios or k3 term (DAPO and Dr. GRPO are `rl.loss_type` values, GSPO `rl.importance_sampling_level`: each
changes one part of GRPO's loss, as in TRL's GRPOConfig). Everything else is GRPO's: the rollout, the
rewards, the global batch of rl.num_generations x rl.prompts_per_step completions, rl.num_iterations, the
rules and the plan (`zerofit.objectives.grpo.GRPOSpec`). The loss is
`zerofit.objectives.rloo.loss.RLOOObjective`.

With rl.beta > 0 each reward loses beta x the completion's summed k1 to the reference (the base with the
adapters off) before the advantages, TRL's (`reward_penalty`); zerofit's rl.beta default stays 0 (a reference
needs LoRA), TRL's RLOO default is 0.05.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerofit.objectives.grpo import GRPOSpec, completions_per_step, describe_rewards

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.protocol import Objective

__all__ = ["RLOO"]


class RLOOSpec(GRPOSpec):
    """RLOO (module docstring)."""

    name = "rloo"

    unread = ("loss_type", "scale_rewards", "importance_sampling_level", "use_bias_correction_kl")
    unread_reason = (
        "a GRPO loss setting; RLOO's loss is TRL's RLOOTrainer's, its advantages rl.normalize_advantages"
    )

    def reward_penalty(self, cfg: ZerofitConfig) -> Callable[..., Any] | None:
        """With rl.beta > 0, TRL's KL in the reward (`zerofit.objectives.rloo.loss.kl_penalty`); else None."""
        if cfg.rl.beta == 0:
            return None
        from zerofit.objectives.grpo.loss import GRPOSettings
        from zerofit.objectives.rloo.loss import kl_penalty

        settings = GRPOSettings(beta=cfg.rl.beta, temperature=cfg.rl.temperature)
        return functools.partial(kl_penalty, s=settings, impl=cfg.train.cross_entropy)

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """The RLOO loss (`zerofit.objectives.rloo.loss`)."""
        from zerofit.objectives.grpo.loss import GRPOSettings
        from zerofit.objectives.rloo.loss import RLOOObjective

        rl = cfg.rl
        settings = GRPOSettings(epsilon=rl.epsilon, epsilon_high=rl.epsilon_high, temperature=rl.temperature)
        return RLOOObjective(settings)

    def advantage_estimator(self, cfg: ZerofitConfig) -> Callable[[Any, int], Any]:
        """The leave-one-out baseline (`zerofit.objectives.rloo.loss.leave_one_out_advantages`)."""
        from zerofit.objectives.rloo.loss import leave_one_out_advantages

        return functools.partial(leave_one_out_advantages, normalize=cfg.rl.normalize_advantages)

    def describe(self, cfg: ZerofitConfig, reference: str) -> str | None:
        """The loss, the global batch in prompts and completions, the updates per rollout and every reward."""
        rl, n = cfg.rl, completions_per_step(cfg)
        high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
        scaled = ", normalized over the batch" if rl.normalize_advantages else ""
        if rl.beta > 0:
            scaled += f", rewards minus {rl.beta:g} x the summed log-ratio to the reference (adapters off)"
        return (
            f"rloo (leave-one-out baseline{scaled}, sequence ratio clip [1 - {rl.epsilon:g}, 1 + {high:g}]): "
            f"{rl.prompts_per_step} prompts x G {rl.num_generations} = {n} completions per step, <= "
            f"{rl.max_prompt_length} + {rl.max_completion_length} tokens each, sampled by the policy (temperature "
            f"{rl.temperature:g}, top_p {rl.top_p:g}, top_k {rl.top_k}); {rl.num_iterations} update(s) per rollout; "
            f"loss over the global batch's {n} completions; rewards: {describe_rewards(rl)}"
        )


RLOO = RLOOSpec()
