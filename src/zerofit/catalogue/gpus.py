"""GPU catalogue: memory a training process can use and dense bf16 tensor-core peak, by short name.

`memory_gib` is what `torch.cuda.get_device_properties(i).total_memory` reports (GiB, 2**30 bytes): the
card's nominal size minus what the driver reserves. The CUDA context and allocator overheads come out of
it and are accounted by the planner's allowance (`memory.allowance_gib`), not here.

`bf16_tflops` is the vendor's dense (no sparsity) bf16 tensor-core peak with fp32 accumulation, the figure
model-FLOPs utilization (MFU) is measured against. GeForce cards accumulate fp32 at half their fp16-accumulate
rate, so their figure is half the headline number. V100 has no bf16: its fp16 figure is given.

`pcie_gbps` is the usable host<->device copy bandwidth of pinned memory, one direction (GB/s, 1e9): about
25 on PCIe 4.0 x16 (32 nominal), 50 on PCIe 5.0 x16, 12 on PCIe 3.0 x16; the planner charges activation
offload's copies with it (`speed.py`). Measured figures vary with the host; these are typical.

`interconnect_gbps` is the GPU<->GPU bandwidth one all-to-all moves data at, one direction (GB/s): NVLink on
SXM boards (A100: 300, H100 / H200: 450 of their 600 / 900 bidirectional), else peer traffic over PCIe
(`pcie_gbps`). The planner charges Ulysses sequence parallelism's all-to-alls with it (`speed.py`); these
are the vendors' figures, not measured by zerofit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from zerofit.core.errors import ConfigError
from zerofit.core.precision import GIB


@dataclass(frozen=True)
class GPU:
    """One GPU model: short name, what torch calls it, usable memory and dense bf16 peak."""

    name: str
    description: str
    memory_gib: float
    bf16_tflops: float
    bf16: bool = True  # supports bf16 (Ampere and newer)
    pcie_gbps: float = 25.0  # usable pinned host<->device bandwidth (PCIe 4.0 x16 unless stated)
    match: tuple[str, ...] = ()  # substrings of torch.cuda.get_device_name() that identify it
    nvlink_gbps: float | None = None  # GPU<->GPU one direction over NVLink (None: peers talk over PCIe)

    @property
    def interconnect_gbps(self) -> float:
        """GPU<->GPU bandwidth of one direction: NVLink's where the board has it, else PCIe's."""
        return self.nvlink_gbps if self.nvlink_gbps is not None else self.pcie_gbps


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("rtx3090", "NVIDIA GeForce RTX 3090 (24 GB)", 23.69, 71.0, match=("RTX 3090",)),
        GPU("rtx4080", "NVIDIA GeForce RTX 4080 (16 GB)", 15.69, 97.5, match=("RTX 4080",)),
        GPU("rtx4090", "NVIDIA GeForce RTX 4090 (24 GB)", 23.65, 165.2, match=("RTX 4090",)),
        GPU("rtx-a6000", "NVIDIA RTX A6000 (48 GB)", 47.53, 154.8, match=("RTX A6000",)),
        # AWS does not publish the A10G's tensor peak; ~70 is the commonly quoted figure (A10: 125).
        GPU("a10g", "NVIDIA A10G (24 GB, AWS g5)", 22.07, 70.0, match=("A10G",)),
        GPU("l4", "NVIDIA L4 (24 GB)", 22.06, 121.0, match=("L4",)),
        GPU("l40s", "NVIDIA L40S (48 GB)", 44.52, 362.0, match=("L40S",)),
        GPU("v100-16gb", "NVIDIA Tesla V100 16 GB (fp16 only)", 15.77, 125.0, False, 12.0, ("V100",)),
        GPU("v100-32gb", "NVIDIA Tesla V100 32 GB (fp16 only)", 31.74, 125.0, False, 12.0, ("V100",)),
        GPU("a100-40gb", "NVIDIA A100 40 GB", 39.39, 312.0, match=("A100",), nvlink_gbps=300.0),
        GPU("a100-80gb", "NVIDIA A100 80 GB", 79.15, 312.0, match=("A100",), nvlink_gbps=300.0),
        GPU(
            "h100-80gb",
            "NVIDIA H100 80 GB (SXM)",
            79.11,
            989.0,
            pcie_gbps=50.0,
            match=("H100",),
            nvlink_gbps=450.0,
        ),
        GPU("h100-pcie", "NVIDIA H100 80 GB PCIe", 79.11, 756.0, pcie_gbps=50.0, match=("H100 PCIe",)),
        GPU("h200", "NVIDIA H200 141 GB", 139.8, 989.0, pcie_gbps=50.0, match=("H200",), nvlink_gbps=450.0),
    )
}


def get_gpu(name: str) -> GPU:
    """The catalogued GPU `name` (case-insensitive; `RTX3090`, `rtx-3090` also match), or a ConfigError."""
    key = name.strip().lower().replace("_", "-")
    for candidate in (key, key.replace("-", ""), key.replace("rtx-", "rtx")):
        if candidate in GPUS:
            return GPUS[candidate]
    known = ", ".join(GPUS)
    raise ConfigError(
        [f"GPU {name!r} is not in the catalogue ({known}); pass its memory instead, e.g. --gpu-mem 24GiB"]
    )


def gpu_from_device_name(device_name: str, total_memory_gib: float | None = None) -> GPU | None:
    """The catalogue entry for a torch device name (`torch.cuda.get_device_name()`), if any.

    Memory (from `get_device_properties().total_memory`) tells apart the 40/80 GB A100s and 16/32 GB V100s.
    """
    found = [g for g in GPUS.values() if any(m in device_name for m in g.match)]
    # The most specific match wins ("H100 PCIe" over "H100").
    if found:
        longest = max(len(m) for g in found for m in g.match if m in device_name)
        found = [g for g in found if any(len(m) == longest and m in device_name for m in g.match)]
    if len(found) > 1 and total_memory_gib is not None:
        found.sort(key=lambda g: abs(g.memory_gib - total_memory_gib))
    return found[0] if found else None


def gpu_peak_tflops(name: str, precision: str = "bf16") -> float:
    """Dense bf16/fp16 tensor peak (TFLOP/s) for a catalogue name or a torch device name (for MFU).

    Raises KeyError for an unknown GPU or a precision without a catalogued peak (fp32).
    """
    if precision not in ("bf16", "fp16"):
        raise KeyError(f"no {precision} peak in the GPU catalogue (only bf16/fp16 tensor peaks)")
    key = name.strip().lower().replace("_", "-")
    if key in GPUS or key.replace("-", "") in GPUS:
        return get_gpu(name).bf16_tflops
    gpu = gpu_from_device_name(name)
    if gpu is None:
        raise KeyError(f"no peak TFLOP/s known for GPU {name!r}")
    return gpu.bf16_tflops


_UNITS = {"gib": 1.0, "gb": 1e9 / GIB, "mib": 1 / 1024, "mb": 1e6 / GIB, "tib": 1024.0, "tb": 1e12 / GIB}


def parse_memory_gib(text: str | float | int) -> float:
    """`24GiB`, `24 GiB`, `24576MiB`, `24GB` (decimal: 22.35 GiB) or a bare number (GiB) -> GiB."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = (match.group(2).lower() if match else "") or "gib"
        if unit == "g":
            unit = "gib"
        if match is None or unit not in _UNITS:
            raise ConfigError(
                [
                    f"GPU memory {text!r} is not understood; write a number with a unit, e.g. 24GiB, "
                    "24576MiB or 24GB (GB and MB are decimal, GiB and MiB binary)"
                ]
            )
        value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError([f"GPU memory {text!r} must be > 0"])
    return value


def detected_gpu() -> tuple[str, float] | None:
    """(device name, total GiB) of CUDA device 0, or None without CUDA (never initialises CUDA needlessly)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / GIB
