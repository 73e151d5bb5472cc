"""Reward models (`train.objective: reward`, the `reward` section): a one-output score head trained with the
Bradley-Terry loss on preference pairs, as TRL's RewardTrainer.

A unit is a pair, as for the pairwise objectives (`PairwiseSpec`: their rules, plan lines and probe batch);
a record without a prompt whose two texts share no beginning is scored as two whole texts; there is no
loss over a vocabulary, so `train.cross_entropy` has nothing to choose. The loss is
`zerofit.objectives.reward_model.loss.RewardObjective`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit.objectives.pairwise import PairwiseSpec

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.protocol import Objective

__all__ = ["REWARD_MODEL"]


class RewardModelSpec(PairwiseSpec):
    """A reward model (module docstring)."""

    name = "reward"
    score_head = True
    whole_texts = True

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """The pairs' rules, then `train.cross_entropy`: refused unless chunked / auto, and set to chunked
        (the planner has no choice to make, and `train.kernels=liger` does not make it fused_linear)."""
        super().check(cfg, problems)
        t = cfg.train
        if t.cross_entropy not in ("chunked", "auto"):
            problems.append(
                f"train.cross_entropy = {t.cross_entropy!r} with train.objective = 'reward': a reward model's loss "
                "is on its one-output score head, not over the vocabulary, so there is no cross-entropy to "
                "choose; unset train.cross_entropy (or set chunked)"
            )
        else:
            t.cross_entropy = "chunked"

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """The Bradley-Terry loss with the section's centering coefficient."""
        from zerofit.objectives.reward_model.loss import RewardObjective

        return RewardObjective(cfg.reward.center_rewards_coefficient)

    def describe(self, cfg: ZerofitConfig, reference: str) -> str | None:
        """The loss, its centering term and the head."""
        center = cfg.reward.center_rewards_coefficient
        return (
            "reward (Bradley-Terry -logsig(r_chosen - r_rejected - margin)"
            + (f" + {center:g} x (r_chosen + r_rejected)^2" if center else "")
            + "; one-output score head), loss per pair over the global batch's pairs"
        )


REWARD_MODEL = RewardModelSpec()
