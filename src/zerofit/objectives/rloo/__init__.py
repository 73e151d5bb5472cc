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

TRL's RLOO subtracts beta x the summed k1 to the reference from each reward; zerofit's RLOO refuses
rl.beta > 0 for now (below), so TRL's default beta 0.05 is not zerofit's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerofit.objectives.grpo import GRPOSpec, completions_per_step, describe_reward

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

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """GRPO's rules (`unread`: GRPO's loss keys); no KL to the reference yet."""
        super().check(cfg, problems)
        if cfg.rl.beta > 0:
            problems.append(
                f"rl.beta = {cfg.rl.beta} with train.objective = 'rloo': RLOO's KL penalty (TRL's: beta x the "
                "summed log-ratio to the reference, subtracted from each reward) is not implemented in zerofit "
                "yet; set rl.beta=0, or use train.objective=grpo for a KL-regularized run"
            )

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
        return (
            f"rloo (leave-one-out baseline{scaled}, sequence ratio clip [1 - {rl.epsilon:g}, 1 + {high:g}]): "
            f"{rl.prompts_per_step} prompts x G {rl.num_generations} = {n} completions per step, <= "
            f"{rl.max_prompt_length} + {rl.max_completion_length} tokens each, sampled by the policy (temperature "
            f"{rl.temperature:g}, top_p {rl.top_p:g}, top_k {rl.top_k}); {rl.num_iterations} update(s) per rollout; "
            f"loss over the global batch's {n} completions; rewards: "
            + "; ".join(describe_reward(spec) for spec in rl.rewards)
        )


RLOO = RLOOSpec()
