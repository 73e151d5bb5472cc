"""One Strategy per engine; the only package that imports torch.distributed.

`launch_env()` (torch-free) says who this process is; `build_strategy()` starts the process group of the
engine a rendered spec names and returns its `Strategy`. Engines are imported lazily so that reading
the launch environment and refusing a bad config never pays for importing torch or DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerofit.strategies.env import LaunchEnv, launch_env

if TYPE_CHECKING:
    from zerofit.engine_spec.spec import EngineSpec
    from zerofit.strategies.base import Strategy

__all__ = ["LaunchEnv", "Strategy", "build_strategy", "launch_env"]


def build_strategy(spec: EngineSpec) -> Strategy:
    """The strategy for `spec`'s engine, with its process group up; it consumes the spec as rendered. Every
    rank's process is recorded (`Strategy.processes`): a rank that stops mid-run is then named by the others."""
    from zerofit.strategies.peers import rank_processes

    strategy = _engine(spec)
    strategy.processes = rank_processes(strategy.all_gather_object)
    return strategy


def _engine(spec: EngineSpec) -> Strategy:
    """The engine's strategy for `spec` (its constructor starts the process group)."""
    from zerofit.engine_spec.spec import DeepSpeedSpec, FSDPSpec, LocalSpec

    env = launch_env()
    if isinstance(spec, DeepSpeedSpec):
        from zerofit.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(env, spec)
    if isinstance(spec, FSDPSpec):
        from zerofit.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(env, spec)
    if isinstance(spec, LocalSpec) and spec.strategy == "ddp":
        from zerofit.strategies.ddp import DDPStrategy

        return DDPStrategy(env, spec)
    if isinstance(spec, LocalSpec):
        from zerofit.strategies.single import SingleStrategy

        return SingleStrategy(env, spec)
    raise TypeError(f"no strategy for {type(spec).__name__}")


def __getattr__(name: str) -> Any:
    if name == "Strategy":
        from zerofit.strategies.base import Strategy

        return Strategy
    raise AttributeError(name)
