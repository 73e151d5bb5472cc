"""CPO (`train.objective: cpo`; Xu et al. 2024, TRL's CPOTrainer): DPO's sigmoid loss on the policy's own
summed response log-probs, no reference model, plus `preference.cpo_alpha` x the NLL of the chosen responses.

    per pair   -logsig(b (pi_c - pi_r)) (1 - ls) - logsig(-b (pi_c - pi_r)) ls      (hinge, ipo: as DPO's, ipo on
                                                                                  per-token means, as TRL's)
    NLL        the chosen response tokens' loss, summed, normalized by the global batch's chosen response tokens
    loss       mean over the global batch's pairs + cpo_alpha x NLL; rewards b pi (TRL's)

One pair loss and one spec over `PreferenceObjective`: the pairwise slice's rules, plan lines and probe batch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from zerofit.objectives.pairwise import PairwiseSpec

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.pairwise.loss import PairLogps, PairLoss, PairResult

__all__ = ["CPO", "cpo_pair"]


def cpo_pair(p: PairLogps, beta: float, loss_type: str, label_smoothing: float) -> PairResult:
    """CPO's pair loss: DPO's losses of the policy's own margin (no reference), rewards beta x log-probs."""
    from zerofit.objectives.pairwise.loss import margin_losses

    logps = p.means if loss_type == "ipo" else p.sums
    losses = margin_losses(logps[0] - logps[1], beta, loss_type, label_smoothing)
    return losses, (beta * logps[0], beta * logps[1]), logps


class CPOSpec(PairwiseSpec):
    """CPO (module docstring)."""

    name = "cpo"

    def pair_loss(self, cfg: ZerofitConfig) -> PairLoss:
        p = cfg.preference
        return functools.partial(
            cpo_pair, beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing
        )

    def nll(self, cfg: ZerofitConfig) -> tuple[str | None, float]:
        """The chosen responses' NLL (TRL's CPO: response tokens only), weighted by cpo_alpha."""
        return "response", cfg.preference.cpo_alpha

    def knobs(self, cfg: ZerofitConfig) -> str:
        p = cfg.preference
        return (
            f"{p.loss_type}, beta {p.beta:g}, label smoothing {p.label_smoothing:g}, alpha {p.cpo_alpha:g} x NLL "
            "over the global batch's chosen response tokens"
        )


CPO = CPOSpec()
