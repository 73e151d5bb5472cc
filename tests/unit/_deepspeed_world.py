"""Build DeepSpeed's own `DeepSpeedConfig` as a rank of a world of size N, without starting N processes.

`DeepSpeedConfig(config, mpu=None)` takes its data-parallel size from `deepspeed.comm.get_world_size()`
(and `get_rank()`); with no process group those raise and it silently falls back to world size 1. To check
the batch arithmetic at dp 2 and 8 honestly, we make `deepspeed.comm` report that world, run DeepSpeed's
unmodified derivation and assertions, and check that the world size it used is the one we asked for.
"""

from __future__ import annotations

from typing import Any
from unittest import mock


def deepspeed_config_at(config: dict[str, Any], world_size: int) -> Any:
    """`deepspeed.runtime.config.DeepSpeedConfig(config, mpu=None)` as seen by one rank of `world_size`."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    with (
        mock.patch.object(deepspeed.comm, "get_rank", lambda group=None: 0),
        mock.patch.object(deepspeed.comm, "get_world_size", lambda group=None: world_size),
    ):
        ds = DeepSpeedConfig(dict(config), mpu=None)
    if ds.world_size != world_size:
        raise RuntimeError(f"DeepSpeedConfig used world size {ds.world_size}, not {world_size}")
    return ds
