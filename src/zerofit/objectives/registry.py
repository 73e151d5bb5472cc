"""The registry: every `train.objective` name and its slice's spec. The one place a name becomes an objective.

`config/schema.py` lists the same names as the key's allowed values (a test holds the two together); the
resolution turns `train.objective` into its spec once (`ResolvedConfig.objective`), and every other part of
zerofit asks that spec (`zerofit.objectives.spec.ObjectiveSpec`). A new objective is a slice and a row here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit.objectives.gkd import GKD
from zerofit.objectives.grpo import GRPO
from zerofit.objectives.kto import KTO
from zerofit.objectives.pairwise import DPO, ORPO, SIMPO
from zerofit.objectives.pairwise.cpo import CPO
from zerofit.objectives.reward_model import REWARD_MODEL
from zerofit.objectives.rloo import RLOO
from zerofit.objectives.sft import SFT
from zerofit.objectives.spec import ObjectiveSpec

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig

__all__ = ["OBJECTIVES", "objective_named", "objective_of", "saved_objective"]

OBJECTIVES: dict[str, ObjectiveSpec] = {
    spec.name: spec for spec in (SFT, DPO, SIMPO, ORPO, CPO, KTO, REWARD_MODEL, GRPO, RLOO, GKD)
}


def objective_named(name: str) -> ObjectiveSpec:
    """The spec of the objective `name` (a `train.objective` value the schema admitted)."""
    return OBJECTIVES[name]


def objective_of(cfg: ZerofitConfig) -> ObjectiveSpec:
    """The spec of `cfg`'s `train.objective`."""
    return OBJECTIVES[cfg.train.objective]


def saved_objective(name: object) -> ObjectiveSpec | None:
    """The spec of an objective named in a file zerofit did not just validate (an export's recorded config):
    None for a missing or unknown name."""
    return OBJECTIVES.get(name) if isinstance(name, str) else None
