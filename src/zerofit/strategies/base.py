"""The verbs the training loop needs from an engine, and nothing more.

The loop owns the gradient-accumulation arithmetic (token-normalized loss, one clip, one step per window);
a strategy only says how to run backward, when to synchronize gradients, and how to step, save and load on
its engine. See "Gradient accumulation" in docs/design.md.

The one number a strategy reports about the arithmetic is `grad_divide_factor` (from its spec): what its
engine divides the *sum* of the ranks' gradients by when it reduces them (DeepSpeed and DDP average over dp
ranks; zerofit sets FSDP2 to sum; one process divides by nothing). The loop multiplies its token-normalized loss by it, in one place, so the
reduced gradient is exactly the gradient of (sum of token losses of the global batch) / (its tokens).
"""

from __future__ import annotations

import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import LaunchError
from zerofit.core.precision import torch_dtype
from zerofit.engine_spec.spec import EngineSpec
from zerofit.strategies.env import LaunchEnv
from zerofit.strategies.peers import RankProcess

# How often a rank waiting for rank 0 (`Strategy.wait_for_rank0`) looks at the store: first after POLL_MIN_S,
# each look twice as late as the one before, up to every POLL_S. Most waits are short (rank 0 loads cached
# tokens or writes a small export in a fraction of a second) and every rank but rank 0 sits out the whole
# wait, so a fixed 0.5 s look kept ~0.3 s per wait on every launch's critical path; the doubling keeps the
# overshoot below the wait's own length and a long wait (hours of tokenizing) at 2 looks per second.
POLL_MIN_S = 0.01
POLL_S = 0.5
# How often rank 1 says it still waits.
HEARTBEAT_S = 300.0

OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def pick_device(env: LaunchEnv) -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is available (and made current), else the CPU."""
    if torch.cuda.is_available():
        if env.local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"LOCAL_RANK = {env.local_rank} but this node has {torch.cuda.device_count()} GPU(s); launch "
                f"at most {torch.cuda.device_count()} processes per node (deepspeed --num_gpus / torchrun "
                "--nproc_per_node)"
            )
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def limit_cpu_threads() -> None:
    """On CPU, give each local rank its share of the cores unless the user set OMP_NUM_THREADS.

    torchrun sets OMP_NUM_THREADS=1; the deepspeed launcher sets nothing, and N ranks each starting a
    thread per core oversubscribe the machine (several times slower on 2 cores).
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // max(local, 1)))


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision the device cannot compute in, before any model is built."""
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise LaunchError(
            f"train.precision = 'bf16' but {name} has no bfloat16 support (it needs compute capability 8.0+, "
            "e.g. RTX 30xx/A100); set train.precision=fp16 (with loss scaling) or fp32"
        )
    if precision == "fp32":
        return
    dtype = torch_dtype(precision)
    try:
        x = torch.ones(4, 4, dtype=dtype, device=device)
        (x @ x).sum().item()
    except (RuntimeError, NotImplementedError) as exc:
        raise LaunchError(
            f"train.precision = {precision!r} is not supported on device {device} ({exc}); set "
            "train.precision=fp32, or run on a device with that dtype"
        ) from None


def backend_for(device: torch.device) -> str:
    """The collective backend: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


class Strategy(ABC):
    """An engine (DeepSpeed, FSDP2, DDP or one process) behind the verbs of the training loop."""

    name: str = "strategy"
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # The engine divides the summed gradient of all ranks by this; the loop multiplies its loss by it.
    grad_divide_factor: float = 1.0
    # False after a `clip_and_step` whose update was skipped (fp16 loss-scale overflow).
    step_applied: bool = True

    def __init__(self, env: LaunchEnv, spec: EngineSpec) -> None:
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.spec = spec
        self.grad_divide_factor = spec.grad_divide_factor
        # Ulysses: groups of `sp_size` consecutive ranks share one sequence (DeepSpeed's
        # `parallel_state_sp` builds them so); the data-parallel rank is the group's index.
        self.sp_size = spec.sequence_parallel
        self.sp_rank, self.dp_rank = self.rank % self.sp_size, self.rank // self.sp_size
        self.dp_world_size = self.world_size // self.sp_size
        self.device = pick_device(env)
        if self.device.type == "cpu":
            limit_cpu_threads()
        self._rank0_waits = 0  # numbers the wait_for_rank0 keys: every rank calls it in the same order
        # Every rank's process (`zerofit.strategies.peers`), recorded by `build_strategy`: names a rank that stops.
        self.processes: list[RankProcess] = []

    @property
    def pg_timeout(self) -> timedelta:
        """The process-group timeout every engine's init receives (`distributed.timeout_minutes`)."""
        return timedelta(minutes=self.spec.timeout_minutes)

    # --- the loop's verbs -------------------------------------------------------------------------------

    @abstractmethod
    def prepare(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory | None,
        make_scheduler: SchedulerFactory,
    ) -> torch.nn.Module:
        """Wrap the model, build optimizer and scheduler on the wrapped parameters; returns the module to call.

        `make_optimizer` is None when the engine brings its own optimizer (DeepSpeed offload presets).
        """

    @abstractmethod
    def accumulate(self, is_last: bool) -> AbstractContextManager[None]:
        """Context for one micro-step (forward and backward); gradients sync only when `is_last` where the
        engine allows skipping it."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of an already token-normalized loss; the engine must not rescale it by GAS."""

    @abstractmethod
    def clip_and_step(self, max_grad_norm: float | None) -> float:
        """After the window: global grad norm (before clipping, a float on every rank), clip, optimizer
        step, scheduler step, zero grad."""

    @abstractmethod
    def current_lr(self) -> float:
        """Learning rate of the first parameter group: the one the next optimizer step uses."""

    # --- state ------------------------------------------------------------------------------------------

    @abstractmethod
    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        """Save engine state (model, optimizer, scheduler, `client_state`) into `directory` (collective)."""

    @abstractmethod
    def load(self, directory: Path, saved_world_size: int) -> dict[str, Any]:
        """Restore engine state from `directory`, saved on `saved_world_size` ranks (which may differ from
        this launch's: elastic resume); returns the saved `client_state` (collective)."""

    def apply_config(self, cfg: ZerofitConfig, lr: float, max_steps: int) -> None:
        """After `load`: write `cfg`'s optimizer hyperparameters (peak `lr`, betas, eps, weight decay) into
        the loaded optimizer and continue on `cfg`'s schedule (over `max_steps`) at the loaded step, so that
        changes a resume accepted are trained with (`zerofit.strategies.optim.resume_schedule`). This default serves
        engines whose client schedule is `self.scheduler` (single, DDP, FSDP2)."""
        from zerofit.strategies.optim import resume_schedule

        scheduler = getattr(self, "scheduler", None)
        if scheduler is None:
            raise RuntimeError(f"strategy {self.name}: prepare() first")
        self.scheduler = resume_schedule(scheduler, self.unwrap(), cfg, lr, max_steps)

    @property
    def checkpoint_format(self) -> str:
        """The layout of this engine's checkpoints; a checkpoint loads only into the same layout (any world
        size). `torch-state`: the whole state in one file (single, DDP)."""
        return "torch-state"

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict gathered on rank 0 (CPU tensors); None on other ranks. Collective."""

    @abstractmethod
    def unwrap(self) -> torch.nn.Module:
        """The underlying (peft/HF) model, for export."""

    # --- communication (identity in one process) -------------------------------------------------------

    @property
    def distributed(self) -> bool:
        """True when a process group is up (even of size 1)."""
        return dist.is_available() and dist.is_initialized()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of `value` over all data-parallel ranks (a new tensor on `value`'s device)."""
        out = value.detach().to(self.device, copy=True)
        if self.distributed and self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(value.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """`obj` from every rank, in rank order (small payloads: per-rank memory stats)."""
        if not (self.distributed and self.world_size > 1):
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not (self.distributed and self.world_size > 1):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""
        if self.distributed and self.world_size > 1:
            dist.barrier()

    def wait_for_rank0(self, what: str) -> None:
        """Every rank calls this once rank 0 may have finished a long job of its own (tokenizing, verifying
        checkpoints, writing the export): the other ranks wait for it through the c10d store, however long it
        takes, instead of inside a collective that the process-group timeout (`distributed.timeout_minutes`;
        NCCL's default is 10 minutes) would abort. Rank 1 says every few minutes that it still waits.

        A rank 0 that dies ends the wait too: the store (or the launcher, which stops every rank) goes away.
        """
        if not (self.distributed and self.world_size > 1):
            return
        self._rank0_waits += 1
        key = f"zerofit/rank0-done/{self._rank0_waits}"
        store = dist.distributed_c10d._get_default_store()
        if self.rank == 0:
            store.set(key, "1")
            return
        started = last_said = time.monotonic()
        delay = POLL_MIN_S
        while not store.check([key]):
            time.sleep(delay)
            delay = min(2 * delay, POLL_S)
            if self.rank == 1 and time.monotonic() - last_said >= HEARTBEAT_S:
                last_said = time.monotonic()
                minutes = (last_said - started) / 60
                print(
                    f"zerofit: rank 1 still waiting for {what} ({minutes:.0f} min)",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        """Tear down the process group; safe to call twice."""
        if self.distributed:
            dist.destroy_process_group()
