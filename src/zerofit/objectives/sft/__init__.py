"""Supervised fine-tuning (`train.objective: sft`): next-token loss on the responses of one example per unit.

Its spec is the defaults of `ObjectiveSpec` plus its rules: it reads any supervised format (not preference
pairs, not KTO's unpaired feedback), may pack examples into rows, cut its rows across ranks (sequence
parallelism) and train vision-language models. The loss is `zerofit.objectives.sft.loss.SFTObjective`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit.objectives.rules import refuse_reference, refuse_unpaired_format
from zerofit.objectives.spec import EXAMPLE, ObjectiveSpec

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.protocol import Objective

__all__ = ["SFT"]


class SFTSpec(ObjectiveSpec):
    """SFT (module docstring)."""

    name = "sft"
    unit = EXAMPLE
    sequence_parallel = True
    vision = True

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """Supervised data, not preference pairs nor unpaired feedback; no preference reference."""
        refuse_unpaired_format(cfg, problems)
        if cfg.data.format == "preference":
            problems.append(
                "data.format = 'preference' is preference pairs (prompt, chosen, rejected), and train.objective = "
                "'sft' learns from one response per record; set train.objective=dpo (or simpo / orpo) to tune on "
                "the pairs, or set data.format to the supervised data's format"
            )
        refuse_reference(cfg, problems)

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """SFT's token sums."""
        from zerofit.objectives.sft.loss import SFTObjective

        return SFTObjective()


SFT = SFTSpec()
