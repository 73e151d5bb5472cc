"""DeepSpeed ZeRO 0-3 (and the offload presets), driven directly (no accelerate).

The spec's DeepSpeed dict is passed to `deepspeed.initialize` as is; it is exactly what the run directory
records, and the spec's facts (ZeRO stage, precision, whether DeepSpeed builds the optimizer) are read
from the spec, never from the dict. Our loop owns the gradient arithmetic, so:

- the accumulation boundary is set explicitly each micro-step (`set_gradient_accumulation_boundary`);
- backward is `engine.backward(loss, scale_wrt_gas=False)`: DeepSpeed must not divide by GAS again, and
  `loss.backward()` is never called on an engine output (ZeRO-1/2 would scale twice, ZeRO-0 raises);
- DeepSpeed averages gradients over the dp ranks, which `grad_divide_factor = dp` reports to the loop;
- clipping (`gradient_clipping` in the config) and the scheduler step happen inside `engine.step()`, once
  per window; the grad norm is DeepSpeed's pre-clip global norm.

ZeRO-0/1 reduce gradients only at the boundary; ZeRO-2/3 reduce-scatter every micro-step by design (their
gradient partitioning needs it): more communication per window, less gradient memory.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from zerofit.config.schema import ZerofitConfig
from zerofit.core.cache_dirs import use_cache_defaults
from zerofit.core.errors import LaunchError, ResumeError
from zerofit.core.messages import say
from zerofit.core.progress import progress
from zerofit.core.writes import WriteGuard
from zerofit.engine_spec.spec import DeepSpeedSpec
from zerofit.strategies.base import (
    OptimizerFactory,
    SchedulerFactory,
    Strategy,
    backend_for,
    check_precision,
)
from zerofit.strategies.env import LaunchEnv

TAG = "engine"  # DeepSpeed's checkpoint tag inside our own (atomic) step directory


def _to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal`), in this process and
    quietly: one worker (no subprocess pool inside a training rank), its progress output captured."""
    import argparse
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(target),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # zerofit's client state has no Megatron-style `universal_checkpoint_info`; the converter adds
        # the default one.
        inject_missing_state=True,
    )
    captured = io.StringIO()
    with redirect_stdout(captured), redirect_stderr(captured):
        ds_to_universal(args)


def _check_accelerator_precision(precision: str, accelerator: Any) -> None:
    """DeepSpeed refuses a half precision its accelerator does not report (e.g. fp16 on a CPU without
    AVX512-FP16/AMX-FP16); say so before any model is built, not as a ValueError deep in initialize()."""
    supported = {
        "bf16": accelerator.is_bf16_supported,
        "fp16": accelerator.is_fp16_supported,
    }.get(precision)
    if supported is not None and not supported():
        other = "bf16" if precision == "fp16" and accelerator.is_bf16_supported() else "fp32"
        raise LaunchError(
            f"train.precision = {precision!r} is not supported by DeepSpeed's "
            f"{accelerator.device_name()} accelerator on this machine (DeepSpeed checks the device's native "
            f"{precision} support); set train.precision={other}, or use distributed.strategy=single or ddp, "
            f"whose autocast runs {precision} where the hardware lacks native support"
        )


# DeepSpeed's JIT-compiled ops a launch can need, by op name, and what each is in the user's words.
JIT_OPS = {"deepspeed_shm_comm": "CPU shared-memory allreduce", "cpu_adam": "CPU Adam"}


def _compiled_on_first_call(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func`, handed to `torch.compile` on its first call instead of when it is decorated."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(func)
        return compiled(*args, **kwargs)

    return call


def compile_deepspeed_kernels_on_first_call() -> None:
    """Make DeepSpeed's `compiler.compile()` decorator compile on a function's first call, not at import.

    DeepSpeed 0.19's Muon module (`deepspeed.runtime.zero.muon.original_muon`, imported by every ZeRO 1-3
    reduction to check whether the optimizer is Muon) decorates its kernels with `torch.compile` at import,
    which resolves the inductor backend and so imports its compiler (`torch._inductor.compile_fx` and its code
    generators, ~160 modules): ~0.7 CPU-s in every rank of every ZeRO launch (a one-process ZeRO-2 run, 4.9
    -> 4.2 CPU-s on a 2-core CPU machine) for kernels a run without Muon never calls. Deferring
    `torch.compile(func)` to the first call compiles the same function with the same backend when it is used;
    unused, it costs nothing. A no-op once that module is imported (its kernels are already decorated).
    """
    from deepspeed.runtime import compiler

    if "deepspeed.runtime.zero.muon.original_muon" not in sys.modules:
        compiler.compile = lambda: _compiled_on_first_call


def jit_ops(device_name: str, cpu_adam: bool) -> list[str]:
    """The JIT ops this launch will load: the CPU allreduce on a CPU accelerator (DeepSpeed's process
    group loads it), CPU Adam when DeepSpeed runs the optimizer step on the CPU (`cpu_adam`: offload)."""
    return ["deepspeed_shm_comm"] * (device_name == "cpu") + ["cpu_adam"] * cpu_adam


def ops_to_compile(ops: list[str], extensions: Path) -> list[str]:
    """Those of `ops` neither installed prebuilt with DeepSpeed nor compiled into `extensions` yet (torch
    JIT-builds op NAME into `<extensions>/NAME/NAME.so`)."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:  # pragma: no cover - every supported DeepSpeed has it
        installed_ops = {}
    return [op for op in ops if not installed_ops.get(op) and not (extensions / op / f"{op}.so").is_file()]


def compile_note(ops: list[str], extensions: Path) -> str:
    """The one line rank 0 prints before DeepSpeed compiles `ops`: what, where, and that it happens once."""
    what = " and ".join(JIT_OPS.get(op, op) for op in ops)
    return (
        f"zerofit: DeepSpeed compiles its {what} once into {extensions} (a minute or two; later launches "
        "reuse it; TORCH_EXTENSIONS_DIR moves it)"
    )


class DeepSpeedStrategy(Strategy):
    """A `DeepSpeedEngine` behind the loop's verbs."""

    name = "deepspeed"

    def __init__(self, env: LaunchEnv, spec: DeepSpeedSpec) -> None:
        super().__init__(env, spec)  # spec.grad_divide_factor = dp: DeepSpeed averages over dp ranks
        self.spec: DeepSpeedSpec = spec
        self.precision = spec.dtypes.precision
        check_precision(self.precision, self.device)
        extensions = use_cache_defaults()  # before DeepSpeed compiles anything: one cache whoever launches
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.utils import logger as ds_logger

        _check_accelerator_precision(self.precision, get_accelerator())
        ops = ops_to_compile(
            jit_ops(get_accelerator().device_name(), spec.offload_optimizer and spec.builds_optimizer),
            extensions,
        )
        if ops:
            say(compile_note(ops, extensions), rank=self.rank)

        ds_logger.setLevel(logging.WARNING)  # DeepSpeed's INFO chatter would bury the plan and progress
        # The ranks meet here, and on a CPU one of them may compile the allreduce op first (also when its
        # .so exists: torch builds again for another Python environment), a minute or two.
        with progress("starting DeepSpeed's process group", enabled=self.rank == 0):
            deepspeed.init_distributed(
                dist_backend=backend_for(self.device),
                auto_mpi_discovery=False,
                verbose=False,
                timeout=self.pg_timeout,
            )
        self._unlink_cpu_allreduce_segment()
        self.stage = spec.zero_stage
        self.engine: Any = None
        self._replaced_attention: tuple[str, Any] | None = None  # (key, function) Ulysses replaced

    def _unlink_cpu_allreduce_segment(self) -> None:
        """Remove the name of this rank's DeepSpeed CPU allreduce segment once every rank has mapped it.

        With every rank on one machine and no GPU, `init_distributed` creates one 66 MB shared-memory
        segment per rank (`/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`) and maps every
        peer's; DeepSpeed never unlinks them, so each CPU launch left ~66 MB per rank in /dev/shm until a
        reboot (a few hundred launches fill it, and then launches hang). A mapped segment outlives its name:
        after a barrier (every peer has mapped it) the name goes and the memory is freed when the last rank
        exits, however it exits.
        """
        if self.device.type != "cpu":
            return
        segment = Path("/dev/shm") / (
            f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{self.rank}"
        )
        # every rank's init_distributed has mapped every peer's segment (one rank: nothing to wait for; a
        # one-rank launch under the `deepspeed` runner creates its segment too, and left it behind)
        self.barrier()
        segment.unlink(missing_ok=True)

    def prepare(
        self,
        model: torch.nn.Module,
        make_optimizer: OptimizerFactory | None,
        make_scheduler: SchedulerFactory,
    ) -> torch.nn.Module:
        import deepspeed

        from zerofit.strategies.optim import param_groups

        compile_deepspeed_kernels_on_first_call()
        config = self.spec.to_json()  # a copy: DeepSpeed fills defaults into the dict it is given
        self._frozen = any(not p.requires_grad for p in model.parameters())
        if make_optimizer is None:
            # The spec's optimizer (offload presets: DeepSpeed's CPU Adam); we only hand it param groups.
            weight_decay = float(config["optimizer"].get("params", {}).get("weight_decay", 0.0))
            optimizer, params = None, param_groups(model, weight_decay)
        else:
            optimizer, params = make_optimizer(model), None
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            mpu=self._ulysses(model),
            optimizer=optimizer,
            model_parameters=params,
            # zerofit's schedule, called with the engine's base optimizer; or none, so that DeepSpeed builds
            # the one the user's file asks for (a client scheduler would silently replace it).
            lr_scheduler=None if self.spec.engine_scheduler else make_scheduler,
            config=config,
            dist_init_required=False,
        )
        return self.engine

    def _ulysses(self, model: torch.nn.Module) -> Any:
        """`distributed.sequence_parallel` > 1: DeepSpeed's Ulysses attention replaces the model's attention
        function (the all-to-all of q/k/v and of the output around it) and its sequence-parallel groups
        become the engine's mpu, so ZeRO partitions and reduces over all ranks and divides by dp = world /
        N (`grad_divide_factor`). None (plain data parallelism) otherwise."""
        if self.sp_size == 1:
            return None
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # DeepSpeed overwrites the attention function's registry entry; `close` puts the original back.
        key = model.config._attn_implementation
        self._replaced_attention = (key, ALL_ATTENTION_FUNCTIONS[key])
        return UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation=key,
            sequence_parallel_size=self.sp_size,
            micro_batch_size=self.spec.batch.micro_batch_size,
            seq_length_is_variable=True,  # every micro-batch is padded to its own longest example
        )

    def accumulate(self, is_last: bool) -> AbstractContextManager[None]:
        self.engine.set_gradient_accumulation_boundary(is_last)
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def _fp32_zero0_norm(self) -> float:
        # ZeRO-0 in fp32 steps the client optimizer directly and leaves the engine's norm unset; at the
        # boundary the gradients on every rank are already the averaged full ones, so the norm is local.
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads))

    def clip_and_step(self, max_grad_norm: float | None) -> float:
        # max_grad_norm is already the config's `gradient_clipping`; DeepSpeed clips inside step().
        del max_grad_norm
        manual = self._fp32_zero0_norm() if self.stage == 0 and self.precision == "fp32" else None
        self.engine.step()
        self.step_applied = bool(self.engine.was_step_applied())
        norm = manual if manual is not None else self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def current_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        # A failed file write inside DeepSpeed's save is recorded, not raised, until the save (and its
        # barriers) has finished on every rank; then it is raised here for the checkpointer to report.
        # (Its writes: the checkpoint engine's files and folders, and rank 0's copy of the recovery scripts.)
        guard = WriteGuard()
        writer = self.engine.checkpoint_engine
        writes = ((writer, "save", 1), (writer, "makedirs", 0), (self.engine, "_copy_recovery_script", 0))
        with guard.guarding(*writes):
            # Frozen base weights (LoRA) are reproducible from the model source: left out of checkpoints.
            self.engine.save_checkpoint(
                str(directory),
                tag=TAG,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=self._frozen,
            )
        guard.raise_recorded()

    @property
    def checkpoint_format(self) -> str:
        return f"deepspeed-zero{self.stage}"

    def load(self, directory: Path, saved_world_size: int) -> dict[str, Any]:
        engine_dir = Path(directory) / TAG
        # ZeRO partitions optimizer state per rank (`*_optim_states.pt`); on another world size DeepSpeed
        # refuses those files, so they go through its universal checkpoint format. Without partitioned
        # state (ZeRO-0) every rank's state is whole and loads on any world size.
        if saved_world_size != self.world_size and any(engine_dir.glob("*optim_states.pt")):
            return self._load_resharded(Path(directory), saved_world_size)
        return self._load(Path(directory))

    def _load(self, directory: Path) -> dict[str, Any]:
        path, client_state = self.engine.load_checkpoint(
            str(directory),
            tag=TAG,
            load_module_strict=not self._frozen,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")
        return dict(client_state or {})

    def _load_resharded(self, directory: Path, saved_world_size: int) -> dict[str, Any]:
        """Elastic resume: rank 0 converts the checkpoint to DeepSpeed's universal format (per-parameter
        full fp32 weights and optimizer state, `deepspeed.checkpoint.ds_to_universal`) in a scratch folder
        next to it; every rank then loads its own partitions of it, and the scratch folder is removed."""
        scratch = directory.with_name(f".{directory.name}-universal")
        failure = None
        if self.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                _to_universal(directory / TAG, scratch / TAG)
            except Exception as exc:  # reported on every rank below, instead of a hang at the barrier
                failure = f"{type(exc).__name__}: {exc}"
                shutil.rmtree(scratch, ignore_errors=True)
        failure = self.broadcast_object(failure)
        if failure is not None:
            raise ResumeError(
                f"checkpoint.resume: {directory} was saved on {saved_world_size} rank(s) and this launch has "
                f"{self.world_size}; converting it to DeepSpeed's universal checkpoint (needed to re-partition "
                f"ZeRO state) failed: {failure}. Resume on {saved_world_size} rank(s), or start a new run "
                "(checkpoint.resume=false)"
            )
        # DeepSpeed reads `checkpoint.load_universal` only while loading; setting it on the engine for this
        # one load keeps ds_config.json what the run trains with.
        config = self.engine._config
        config.load_universal_checkpoint = True
        try:
            client_state = self._load(scratch)
        finally:
            config.load_universal_checkpoint = False
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        return client_state

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()  # collective; rank 0 gets it
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.engine.module.state_dict().items()}

    def unwrap(self) -> torch.nn.Module:
        return self.engine.module

    def apply_config(self, cfg: ZerofitConfig, lr: float, max_steps: int) -> None:
        # A DeepSpeed schedule from the user's file keeps its own curve (zerofit's scheduler.* do not run);
        # an optimizer DeepSpeed built from the user's file keeps that file's hyperparameters.
        if self.spec.engine_scheduler is not None:
            return
        from zerofit.strategies.optim import resume_schedule

        from_user_file = self.spec.builds_optimizer and self.spec.user_file is not None
        self.engine.lr_scheduler = resume_schedule(
            self.engine.lr_scheduler, self.engine.module, cfg, None if from_user_file else lr, max_steps
        )

    def close(self) -> None:
        self.engine = None
        if self.distributed:
            import deepspeed.comm

            # DeepSpeed's teardown also drops the groups it cached (a clone of the world group); torch's
            # alone would leave them, and a second run in the same process (`zerofit.train` called twice
            # in a notebook) would reuse a dead group.
            deepspeed.comm.destroy_process_group()
        if self.sp_size > 1:
            # The groups of `parallel_state_sp` are module globals that refuse a second initialization:
            # a later run in this process builds its own.
            from deepspeed.runtime.sequence_parallel import parallel_state_sp

            parallel_state_sp._release_sequence_parallel_groups()
        if self._replaced_attention is not None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            key, original = self._replaced_attention
            ALL_ATTENTION_FUNCTIONS[key] = original
            self._replaced_attention = None
