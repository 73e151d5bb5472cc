"""What each engine receives: typed specs (`spec.py`), rendered once from a resolved config (`render.py`)."""

from zerofit.engine.render import render_spec
from zerofit.engine.spec import (
    DeepSpeedSpec,
    EngineSpec,
    FSDPSpec,
    GradSync,
    LocalSpec,
    engine_config_filename,
)

__all__ = [
    "DeepSpeedSpec",
    "EngineSpec",
    "FSDPSpec",
    "GradSync",
    "LocalSpec",
    "engine_config_filename",
    "render_spec",
]
