"""What an engine will run with, before any engine runs: the typed spec of each engine (`spec.py`), rendered
once from a resolved config (`render.py`), and the run plan around it (`run_plan.py`). The running engines,
which take this spec, are `zerofit.strategies`."""

from zerofit.engine_spec.render import render_spec
from zerofit.engine_spec.spec import (
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
