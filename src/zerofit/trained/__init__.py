"""A finished run read back: where its weights are (`checkpoints.py`, the one reader of every engine's
checkpoint layout and of the final export), the model as it trained (`model.py`: the base as the run loaded
it, dequantized, plus its adapters), and sampling (`generate.py`, `zerofit generate`) and scoring
(`score.py`, `zerofit score`) from it or from an export. Writing an export is `zerofit.export`'s."""

from zerofit.trained.checkpoints import WeightsSource, find_weights, read_checkpoint
from zerofit.trained.model import RunConfig, TrainedModel, build_trained, load_trained, read_run_config

__all__ = [
    "RunConfig",
    "TrainedModel",
    "WeightsSource",
    "build_trained",
    "find_weights",
    "load_trained",
    "read_checkpoint",
    "read_run_config",
]
