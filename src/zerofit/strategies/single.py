"""One process, plain PyTorch: autocast for bf16/fp16, a GradScaler for fp16 (unscaled before clipping).

`SingleStrategy` is also the base of `DDPStrategy`: both hold the whole model and optimizer on every rank,
so stepping, saving and loading are the same; DDP only adds the wrapper and the gradient all-reduce.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch

from zerofit.core.precision import torch_dtype
from zerofit.core.writes import torch_save
from zerofit.engine_spec.spec import LocalSpec
from zerofit.strategies.base import OptimizerFactory, SchedulerFactory, Strategy, check_precision
from zerofit.strategies.env import LaunchEnv

# A checkpoint's layout (step-N/), written here and read back by `zerofit.trained.checkpoints`:
STATE_FILE = "state.pt"  # torch.save of {STATE_MODEL_KEY: the trainable tensors, "optimizer": ..., ...}
STATE_MODEL_KEY = "model"


def grad_norm_and_clip(params: list[torch.nn.Parameter], max_grad_norm: float | None) -> torch.Tensor:
    """Total 2-norm of the gradients (before clipping); clips in place when `max_grad_norm` > 0."""
    grads = [p for p in params if p.grad is not None]
    if max_grad_norm:
        return torch.nn.utils.clip_grad_norm_(grads, max_grad_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in grads])


class SingleStrategy(Strategy):
    """The whole model and optimizer in this process; no gradient communication."""

    name = "single"

    def __init__(self, env: LaunchEnv, spec: LocalSpec) -> None:
        super().__init__(env, spec)
        dtypes = spec.dtypes
        check_precision(dtypes.precision, self.device)
        self.autocast_dtype = torch_dtype(dtypes.autocast) if dtypes.autocast else None
        self.scaler = torch.amp.GradScaler(self.device.type) if dtypes.loss_scaling else None
        self.model: torch.nn.Module | None = None
        self.model_parameters: list[torch.nn.Parameter] = []  # the model's, found once by `prepare`
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Hook for subclasses (DDP); one process runs the model as is."""
        return model

    def prepare(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory | None,
        make_scheduler: SchedulerFactory,
    ) -> torch.nn.Module:
        if make_optimizer is None:
            raise ValueError(f"strategy {self.name} needs a client optimizer")
        model.to(self.device)
        self.optimizer = make_optimizer(model)
        self.scheduler = make_scheduler(self.optimizer)
        self.model = self._wrap(model)
        # Every parameter, listed once: walking a peft model's modules for them cost more per step (~0.2 ms
        # on the demo) than clipping them; the clip takes those with a gradient, in this order, as before.
        self.model_parameters = list(self.model.parameters())
        return self.model

    def _no_sync(self, is_last: bool) -> AbstractContextManager[Any]:
        """Hook for DDP; one process has nothing to sync."""
        del is_last
        return nullcontext()

    def accumulate(self, is_last: bool) -> AbstractContextManager[Any]:
        """The micro-step's contexts: DDP's `no_sync` (none in one process) and autocast (bf16/fp16). Without
        autocast, the sync context itself: an exit stack around one context costs more than the context."""
        sync = self._no_sync(is_last)
        if self.autocast_dtype is None:
            return sync
        stack = ExitStack()
        stack.enter_context(sync)
        stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype))
        return stack

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        assert self.optimizer is not None and self.model is not None, "prepare() first"
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient, not the scaled one
        norm = float(grad_norm_and_clip(self.model_parameters, max_grad_norm))
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when the gradients overflowed
            self.scaler.update()
            self.step_applied = self.scaler.get_scale() >= scale_before
        else:
            self.optimizer.step()
            self.step_applied = True
        if self.step_applied:  # like DeepSpeed: a skipped update does not advance the schedule
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def current_lr(self) -> float:
        assert self.optimizer is not None, "prepare() first"
        return float(self.optimizer.param_groups[0]["lr"])

    # --- state: every rank holds the same full state; rank 0 writes, every rank reads --------------------

    def unwrap(self) -> torch.nn.Module:
        assert self.model is not None, "prepare() first"
        return getattr(self.model, "module", self.model)

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        # Frozen weights (a LoRA base) are reproducible from the model source; only what trains is saved.
        model = self.unwrap()
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        return {k: v.detach().cpu() for k, v in model.state_dict().items() if k in trainable}

    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        assert self.optimizer is not None, "prepare() first"
        if self.rank != 0:
            return
        state = {
            STATE_MODEL_KEY: self._trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "client_state": client_state,
        }
        torch_save(state, Path(directory) / STATE_FILE)  # a full disk raises OSError naming the file

    def load(self, directory: Path, saved_world_size: int) -> dict[str, Any]:
        # Every rank saved (rank 0 wrote) the same full state: any world size loads it.
        del saved_world_size
        assert self.optimizer is not None, "prepare() first"
        state = torch.load(Path(directory) / STATE_FILE, map_location=self.device, weights_only=True)
        missing = set(self._trainable_state()) - set(state[STATE_MODEL_KEY])
        if missing:
            raise RuntimeError(f"checkpoint {directory} lacks trainable weights: {sorted(missing)[:5]}")
        self.unwrap().load_state_dict(state[STATE_MODEL_KEY], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        return dict(state["client_state"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.unwrap().state_dict().items()}
