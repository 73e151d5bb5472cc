"""The one precision table: `train.precision` -> the dtype of every tensor a run holds.

Every layer asks here: the model loader (what `from_pretrained` loads in), the renderer (DeepSpeed's
bf16/fp16 blocks, FSDP2's mixed-precision policy, autocast for one process and DDP), the strategies (the
torch dtypes they cast to and check the device for) and the memory planner (bytes per element). Nothing
else spells `"bfloat16"` or maps `"bf16"` to a torch dtype.

The dtype rule (`tensor_dtypes`):
  - fp32: every tensor fp32.
  - bf16/fp16 with LoRA (or QLoRA): the frozen base weights are loaded in that half dtype (half the memory;
    they never receive updates); peft keeps the adapters fp32 (`autocast_adapter_dtype`), so the optimizer
    updates full-precision values.
  - bf16/fp16 full fine-tuning: fp32 weights (the master copy); the half dtype comes from the engine:
    autocast for `single` / `ddp`, every parameter cast for DeepSpeed, FSDP2's `param_dtype`.
  - gradients are reduced in fp32 under FSDP2; fp16 always needs loss scaling.

No torch import at module level: `zerofit plan` and the renderer run without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "GIB",
    "Dtype",
    "TensorDtypes",
    "cpu_computes_bf16",
    "dtype_bytes",
    "tensor_dtypes",
    "torch_dtype",
]

# Bytes in a GiB (2**30): the unit of every memory figure zerofit shows, measures or predicts (the planner,
# the memory telemetry, the GPU catalogue, the probe). An int, so `n * GIB` stays a byte count.
GIB = 1 << 30


@dataclass(frozen=True)
class Dtype:
    """One floating-point dtype: zerofit's short name, torch's name and its size in bytes."""

    name: str  # the spelling of `train.precision`: fp32, bf16, fp16
    torch_name: str  # float32, bfloat16, float16
    bytes: int


DTYPES: dict[str, Dtype] = {
    "fp32": Dtype("fp32", "float32", 4),
    "bf16": Dtype("bf16", "bfloat16", 2),
    "fp16": Dtype("fp16", "float16", 2),
}
_BY_ANY_NAME = {**DTYPES, **{d.torch_name: d for d in DTYPES.values()}}


def _lookup(name: str) -> Dtype:
    try:
        return _BY_ANY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_BY_ANY_NAME)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for `name` (either spelling: `bf16` or `bfloat16`)."""
    import torch

    return getattr(torch, _lookup(name).torch_name)


def cpu_computes_bf16() -> bool:
    """Whether this CPU has oneDNN's bfloat16 kernels (AVX512-BW/VL/DQ, AVX512-BF16, AMX, or Arm's BF16).

    Without them torch still computes bf16 on the CPU, through a reference path: measured on an AMD EPYC with
    AVX2 only (torch 2.13), one LoRA step of SmolLM2-135M took ~140 CPU-s in bf16 against ~7 in fp32. On such
    a CPU fp32 is the fast choice; with the kernels bf16 is as fast or faster. Torch's own check (the one its
    CPU tests use); a torch without it counts as having the kernels, so nothing changes there. oneDNN turned
    off in this process (`torch.backends.mkldnn.enabled = False`) leaves bf16 to the reference path too.
    """
    import torch

    if not torch.backends.mkldnn.enabled:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def dtype_bytes(name: str) -> int:
    """Bytes per element of `name` (either spelling)."""
    return _lookup(name).bytes


@dataclass(frozen=True)
class TensorDtypes:
    """What dtype each tensor of a run gets, by `train.precision`, strategy and adaptation (short names)."""

    precision: str  # train.precision
    half: str | None  # bf16 / fp16 when training in half precision, None in fp32
    load: str  # the dtype `from_pretrained` loads every weight in
    trainable: str  # LoRA adapters (peft keeps them fp32) and full fine-tuning's master weights
    autocast: str | None  # single / ddp: `torch.autocast` dtype around forward and backward
    engine_param: str | None  # DeepSpeed / FSDP2: the dtype every parameter computes in
    reduce: str  # the dtype gradients are reduced (and, with FSDP2, accumulated) in
    loss_scaling: bool  # fp16: a (dynamic) loss scale guards against underflow

    @property
    def half_cast(self) -> str | None:
        """The engine's parameter cast when it changes anything (DeepSpeed / FSDP2 in half precision)."""
        return self.engine_param if self.half else None


def tensor_dtypes(precision: str, strategy: str, *, lora: bool) -> TensorDtypes:
    """The dtype rule (module docstring) for one run."""
    if precision not in DTYPES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(DTYPES)}")
    half = precision if precision != "fp32" else None
    engine_casts = strategy in ("deepspeed", "fsdp")
    return TensorDtypes(
        precision=precision,
        half=half,
        load=half if (half and lora) else "fp32",
        trainable="fp32",
        autocast=half if (half and not engine_casts) else None,
        engine_param=precision if engine_casts else None,
        reduce="fp32",
        loss_scaling=precision == "fp16",
    )
