"""Plain PyTorch DistributedDataParallel: every rank holds the whole model; gradients are averaged over dp.

Accumulation skips the all-reduce on non-boundary micro-steps (`no_sync`), so one window costs one
gradient all-reduce. DDP averages (divides the sum by dp), which `grad_divide_factor` reports to the loop.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zerofit.engine_spec.spec import LocalSpec
from zerofit.strategies.base import backend_for
from zerofit.strategies.env import LaunchEnv
from zerofit.strategies.single import SingleStrategy


class DDPStrategy(SingleStrategy):
    """SingleStrategy plus a process group, the DDP wrapper and `no_sync` inside the window."""

    name = "ddp"

    def __init__(self, env: LaunchEnv, spec: LocalSpec) -> None:
        super().__init__(env, spec)  # spec.grad_divide_factor = dp: DDP averages gradients over ranks
        if not dist.is_initialized():
            dist.init_process_group(
                backend_for(self.device), device_id=self._device_id(), timeout=self.pg_timeout
            )

    def _device_id(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def _no_sync(self, is_last: bool) -> AbstractContextManager[Any]:
        assert isinstance(self.model, DistributedDataParallel), "prepare() first"
        return nullcontext() if is_last else self.model.no_sync()
