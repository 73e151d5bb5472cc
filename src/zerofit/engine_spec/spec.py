"""Typed engine specs: what one engine receives for one resolved run, rendered once by `render.py`.

A spec answers every question about the engine exactly once, for every reader: the strategy that drives
the engine, the memory planner's scenario, the plan printed at launch, and the engine file in the run
directory (`to_json()`, byte for byte what the engine ran with).

    DeepSpeedSpec   the concrete DeepSpeed config dict + the facts read off it (ZeRO stage, offload, who
                    builds the optimizer)
    FSDPSpec        the FSDP2 plan: mesh, resharding, offload, mixed precision, wrap class, sync policy
    LocalSpec       one process (`single`) or DDP: autocast, loss scaling, sync policy

No torch import: specs are rendered and printed on machines without torch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

from zerofit.config.batching import BatchSplit
from zerofit.core.precision import TensorDtypes, torch_dtype
from zerofit.core.run_layout import ENGINE_FILES

__all__ = ["DeepSpeedSpec", "EngineSpec", "FSDPSpec", "GradSync", "LocalSpec", "engine_config_filename"]

_FILENAMES = ENGINE_FILES  # the run directory's layout names them


def engine_config_filename(strategy: str) -> str:
    """File name of the engine config inside the run directory (docs/contracts.md, "Run directory")."""
    try:
        return _FILENAMES[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(_FILENAMES)}") from None


@dataclass(frozen=True)
class GradSync:
    """When gradients are communicated inside an accumulation window, and what that costs."""

    policy: Literal["none", "boundary_only", "every_micro_step"]
    reason: str

    @property
    def every_micro_step(self) -> bool:
        """True when each micro-step reduces gradients (no skipping inside the window)."""
        return self.policy == "every_micro_step"


@dataclass(frozen=True)
class EngineSpec:
    """What every engine spec states: the strategy, the split, the dtypes, clipping and gradient sync."""

    strategy: str  # deepspeed | fsdp | single | ddp
    preset: str | None
    batch: BatchSplit
    dtypes: TensorDtypes
    max_grad_norm: float | None
    sync: GradSync
    # What the engine divides the sum of the ranks' gradients by; the loop multiplies its loss by it.
    grad_divide_factor: float
    # How long a collective may wait for a peer (`distributed.timeout_minutes`), given to the process group.
    timeout_minutes: float = 30.0
    # Ranks that share one sequence (`distributed.sequence_parallel`, Ulysses); dp = world / this.
    sequence_parallel: int = 1

    @property
    def filename(self) -> str:
        """The engine file's name in the run directory."""
        return engine_config_filename(self.strategy)

    @property
    def builds_optimizer(self) -> bool:
        """True when the engine creates the optimizer itself (from its config) instead of zerofit."""
        return False

    @property
    def offloads_optimizer(self) -> bool:
        """True when optimizer state (and its step) lives in host memory."""
        return False

    def describe_engine(self) -> str:
        """`strategy / preset`, as the plan prints it."""
        return self.strategy + (f" / {self.preset}" if self.preset else "")

    def describe_grad_sync(self) -> str:
        """One line for the plan: when gradients are communicated inside a window."""
        if self.batch.dp_size == 1:
            return "none (one data-parallel rank)"
        if self.sync.every_micro_step:
            return "every micro-step"
        return "once per window (no sync inside it)"

    def describe_optimizer(self, name: str) -> str:
        """The optimizer that runs the step: `optimizer.name`, or the engine's own."""
        return name

    def describe_schedule(self, name: str, warmup_steps: int) -> str:
        """The LR schedule that runs: zerofit's `scheduler.*`, or the engine's own (a DeepSpeed block)."""
        return f"{name} schedule, warmup {warmup_steps}"

    def to_json(self) -> dict[str, Any]:
        """The engine file's contents (what the engine receives, as JSON)."""
        raise NotImplementedError


def _train_batch(plan: BatchSplit) -> dict[str, int]:
    return {
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum_steps": plan.grad_accum_steps,
        "dp_size": plan.dp_size,
    }


def _accumulation(plan: BatchSplit, sync: GradSync) -> dict[str, Any]:
    return {"grad_accum_steps": plan.grad_accum_steps, "sync": sync.policy, "reason": sync.reason}


@dataclass(frozen=True)
class DeepSpeedSpec(EngineSpec):
    """DeepSpeed ZeRO 0-3: the exact config dict `deepspeed.initialize` receives, and its facts."""

    config: dict[str, Any] = field(repr=False, default_factory=dict)
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    # DeepSpeed builds the optimizer from the config's `optimizer` block (its CPU Adam under offload).
    engine_optimizer: str | None = None
    user_file: str | None = None  # distributed.ds_config, when the config came from the user's file
    # DeepSpeed builds the LR schedule from the config's `scheduler` block (a user file's); zerofit's
    # scheduler.* then does not run, and the strategy passes no scheduler of its own.
    engine_scheduler: str | None = None

    @property
    def builds_optimizer(self) -> bool:
        return self.engine_optimizer is not None

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer

    def describe_grad_sync(self) -> str:
        # Sequence-parallel ranks reduce too: each shard holds part of every parameter's gradient.
        if self.batch.dp_size * self.sequence_parallel == 1:
            return super().describe_grad_sync()
        if self.zero_stage >= 2:
            return (
                f"every micro-step (ZeRO-{self.zero_stage} reduce-scatters into its gradient partitions by "
                "design)"
            )
        return f"once per window, at the boundary (ZeRO-{self.zero_stage})"

    def describe_schedule(self, name: str, warmup_steps: int) -> str:
        if self.engine_scheduler is None:
            return super().describe_schedule(name, warmup_steps)
        params = self.config.get("scheduler", {}).get("params", {})
        shown = ", ".join(f"{k} {v}" for k, v in params.items()) if isinstance(params, dict) else ""
        return (
            f"DeepSpeed {self.engine_scheduler} schedule from {self.user_file or 'the engine config'}"
            + (f" ({shown})" if shown else "")
            + f"; scheduler.name {name!r} is not used"
        )

    def describe_optimizer(self, name: str) -> str:
        if self.engine_optimizer is not None:
            return f"DeepSpeed {self.engine_optimizer} (offload preset, runs the step on the CPU)"
        return name

    def to_json(self) -> dict[str, Any]:
        return copy.deepcopy(self.config)


@dataclass(frozen=True)
class FSDPSpec(EngineSpec):
    """PyTorch FSDP2 (`fully_shard` per decoder layer, then the root) over a 1-D data-parallel mesh."""

    mesh_device_type: str = "cpu"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    pin_memory: bool = False  # pinned host memory for offload (needs an accelerator)
    layer_class: str = "LlamaDecoderLayer"
    notes: str = ""

    @property
    def offloads_optimizer(self) -> bool:
        return self.cpu_offload

    # FSDP2's MixedPrecisionPolicy, as torch dtypes (the strategy's view of `dtypes`).
    def mixed_precision_dtypes(self) -> dict[str, Any]:
        """`param_dtype`, `reduce_dtype`, `output_dtype` for `MixedPrecisionPolicy` (torch dtypes)."""
        return {name: torch_dtype(value) for name, value in self._mixed_precision().items()}

    def _mixed_precision(self) -> dict[str, str]:
        param = str(self.dtypes.engine_param)
        return {"param_dtype": param, "reduce_dtype": self.dtypes.reduce, "output_dtype": param}

    def to_json(self) -> dict[str, Any]:
        from zerofit.core.precision import DTYPES

        return {
            "strategy": self.strategy,
            "preset": self.preset,
            "mesh": {
                "device_type": self.mesh_device_type,
                "shape": [self.batch.dp_size],
                "dim_names": ["dp"],
            },
            "reshard_after_forward": self.reshard_after_forward,
            "cpu_offload": self.cpu_offload,
            "cpu_offload_pin_memory": self.pin_memory,
            "mixed_precision": {k: DTYPES[v].torch_name for k, v in self._mixed_precision().items()},
            "grad_scaler": self.dtypes.loss_scaling,
            "wrap": {"layer_class": self.layer_class, "root": True},
            "gradient_accumulation": _accumulation(self.batch, self.sync),
            "gradient_divide_factor": self.grad_divide_factor,
            "notes": self.notes,
            "train_batch": _train_batch(self.batch),
            "max_grad_norm": self.max_grad_norm,
        }


@dataclass(frozen=True)
class LocalSpec(EngineSpec):
    """One process (`single`) or plain DDP: the whole model on every rank, autocast for half precision."""

    notes: str = ""

    def to_json(self) -> dict[str, Any]:
        from zerofit.core.precision import DTYPES

        autocast = self.dtypes.autocast
        return {
            "strategy": self.strategy,
            "precision": self.dtypes.precision,
            "autocast_dtype": DTYPES[autocast].torch_name if autocast else None,
            "grad_scaler": self.dtypes.loss_scaling,
            "train_batch": _train_batch(self.batch),
            "gradient_accumulation": _accumulation(self.batch, self.sync),
            "notes": self.notes,
            "max_grad_norm": self.max_grad_norm,
        }
