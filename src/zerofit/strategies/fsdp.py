"""PyTorch FSDP2 (`fully_shard`), driven by its spec (`FSDPSpec`; `fsdp.json` in the run directory).

Order, as the plan says: each decoder layer (by class name) is `fully_shard`-ed, then the root, so every
layer's parameters are gathered and freed on their own and the root holds only embeddings, final norm and
head. Then the optimizer is built on the sharded (DTensor) parameters.

Accumulation: with `sync = boundary_only` gradient reduce-scatter is skipped on non-boundary micro-steps
(`set_requires_gradient_sync(False)`: one reduce-scatter per window, but each rank holds an unsharded
gradient copy meanwhile); with `every_micro_step` gradients are reduce-scattered and accumulated sharded.
FSDP divides the summed gradient by the spec's `grad_divide_factor` (zerofit sets 1.0: FSDP sums), which
is reported to the loop as `grad_divide_factor`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from zerofit.core.errors import ConfigError
from zerofit.core.writes import torch_save
from zerofit.engine_spec.spec import FSDPSpec
from zerofit.levers.layers import no_split_classes
from zerofit.strategies.base import (
    OptimizerFactory,
    SchedulerFactory,
    Strategy,
    backend_for,
    check_precision,
)
from zerofit.strategies.env import LaunchEnv
from zerofit.strategies.fsdp_layout import DCP_DIR, DCP_MODEL_KEY, DCP_OPTIM_KEY, EXTRA_FILE


class FSDPStrategy(Strategy):
    """FSDP2 shards of the model, an optimizer over DTensor parameters, DCP checkpoints."""

    name = "fsdp"

    def __init__(self, env: LaunchEnv, spec: FSDPSpec) -> None:
        super().__init__(env, spec)
        self.spec: FSDPSpec = spec
        if spec.dtypes.half is not None:
            check_precision(spec.dtypes.half, self.device)
        if not dist.is_initialized():
            device_id = self.device if self.device.type == "cuda" else None
            dist.init_process_group(backend_for(self.device), device_id=device_id, timeout=self.pg_timeout)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))
        # fp16 needs loss scaling; the sharded scaler agrees on overflow across ranks (one all-reduce).
        self.scaler = ShardedGradScaler(self.device.type) if spec.dtypes.loss_scaling else None
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None

    def _policies(self) -> dict[str, Any]:
        spec = self.spec
        offload = CPUOffloadPolicy(pin_memory=spec.pin_memory) if spec.cpu_offload else OffloadPolicy()
        return {
            "mesh": self.mesh,
            "reshard_after_forward": spec.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(**spec.mixed_precision_dtypes()),
            "offload_policy": offload,
        }

    def prepare(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory | None,
        make_scheduler: SchedulerFactory,
    ) -> torch.nn.Module:
        if make_optimizer is None:
            raise ValueError("FSDP needs a client optimizer")
        layer_class = self.spec.layer_class
        classes = set(layer_class.split(","))  # a vision-language model: its vision blocks too
        layers = [m for m in model.modules() if type(m).__name__ in classes]
        if not layers:
            found = sorted({type(m).__name__ for m in model.modules() if "Layer" in type(m).__name__})
            raise ConfigError(
                [
                    f"distributed.strategy = 'fsdp': the model ({type(model).__name__}) has no module of class "
                    f"{layer_class!r}, the decoder layer its config names, to shard per layer (the model's own "
                    f"_no_split_modules: {', '.join(no_split_classes(model)) or 'none'}; layer-like classes: "
                    f"{', '.join(found) or 'none'}), so it cannot be wrapped. Fix: distributed.strategy=deepspeed"
                ]
            )
        policies = self._policies()
        # Per layer first, then the root: each layer becomes its own all-gather / reduce-scatter group.
        for layer in layers:
            fully_shard(layer, **policies)
        fully_shard(model, **policies)
        # The spec's factor replaces FSDP's default average over the dp ranks (zerofit: 1.0, a sum).
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(self.grad_divide_factor)
                # A custom factor otherwise uses NCCL's PREMUL_SUM, which gloo lacks; plain SUM + a
                # separate scaling works on every backend.
                module.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.optimizer = make_optimizer(model)  # on the sharded DTensor parameters
        self.scheduler = make_scheduler(self.optimizer)
        return model

    def accumulate(self, is_last: bool) -> AbstractContextManager[None]:
        if not self.spec.sync.every_micro_step:
            self.model.set_requires_gradient_sync(is_last)
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        assert self.optimizer is not None, "prepare() first"
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient, not the scaled one
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):  # a partial norm per shard: reduce to the global norm on every rank
            total = total.full_tensor()
        if max_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, total)
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped (on every rank) when any rank's gradients overflowed
            self.scaler.update()
            self.step_applied = self.scaler.get_scale() >= scale_before
        else:
            self.optimizer.step()
        if self.step_applied:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)

    def current_lr(self) -> float:
        assert self.optimizer is not None, "prepare() first"
        return float(self.optimizer.param_groups[0]["lr"])

    # --- state -----------------------------------------------------------------------------------------

    def _options(self, **kwargs: Any) -> StateDictOptions:
        # Frozen base weights (LoRA) are reproducible from the model source: not checkpointed.
        return StateDictOptions(ignore_frozen_params=True, **kwargs)

    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        dcp.save(
            {DCP_MODEL_KEY: model_sd, DCP_OPTIM_KEY: optim_sd}, checkpoint_id=str(Path(directory) / DCP_DIR)
        )
        if self.rank == 0:
            extra = {"scheduler": self.scheduler.state_dict(), "client_state": client_state}
            torch_save(extra, Path(directory) / EXTRA_FILE)

    @property
    def checkpoint_format(self) -> str:
        return "fsdp-dcp"

    def load(self, directory: Path, saved_world_size: int) -> dict[str, Any]:
        # DCP reshards on load: a checkpoint saved on any number of ranks loads onto this mesh.
        del saved_world_size
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        state = {DCP_MODEL_KEY: model_sd, DCP_OPTIM_KEY: optim_sd}
        dcp.load(state, checkpoint_id=str(Path(directory) / DCP_DIR))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state[DCP_MODEL_KEY],
            optim_state_dict=state[DCP_OPTIM_KEY],
            options=self._options(strict=False),
        )
        extra = torch.load(Path(directory) / EXTRA_FILE, map_location="cpu", weights_only=True)
        self.scheduler.load_state_dict(extra["scheduler"])
        return dict(extra["client_state"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)  # collective; full on rank 0
        return state if self.rank == 0 else None

    def unwrap(self) -> torch.nn.Module:
        return self.model
