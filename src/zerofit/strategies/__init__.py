"""One Strategy per engine; the only package that imports torch.distributed.

`launch_env()` (torch-free) says who this process is; `build_strategy()` starts the process group of the
engine the resolved config names and returns its `Strategy`. Engines are imported lazily so that reading
the launch environment and refusing a bad config never pays for importing torch or DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerofit.strategies.env import LaunchEnv, launch_env

if TYPE_CHECKING:
    from zerofit.config.resolve import ResolvedConfig
    from zerofit.strategies.base import Strategy

__all__ = ["LaunchEnv", "Strategy", "build_strategy", "launch_env"]


def build_strategy(resolved: ResolvedConfig, engine_config: dict[str, Any]) -> Strategy:
    """The strategy for `distributed.strategy`, with its process group up, consuming the rendered config."""
    env = launch_env()
    name = resolved.config.distributed.strategy
    if name == "deepspeed":
        from zerofit.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(env, engine_config)
    if name == "fsdp":
        from zerofit.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(env, engine_config)
    if name == "ddp":
        from zerofit.strategies.ddp import DDPStrategy

        return DDPStrategy(env, engine_config)
    if name == "single":
        from zerofit.strategies.single import SingleStrategy

        return SingleStrategy(env, engine_config)
    raise ValueError(f"unknown strategy {name!r}")  # the schema only admits the four above


def __getattr__(name: str) -> Any:
    if name == "Strategy":
        from zerofit.strategies.base import Strategy

        return Strategy
    raise AttributeError(name)
