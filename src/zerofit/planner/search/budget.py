"""The memory budget a plan is held to (a GPU's usable memory less the headroom) and the verdict for it.

Verdicts, for the card's usable memory M (torch's `total_memory`):
  - fits:          total (tensors + allowance) <= (1 - headroom) x M    (headroom: planner.headroom, 5%)
  - tight:         fits in M but inside the headroom: may OOM on an unlucky allocation pattern
  - does not fit:  total > M
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerofit.catalogue.gpus import GPU, detected_gpu, get_gpu, gpu_from_device_name, parse_memory_gib

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


DEFAULT_HEADROOM = 0.05


@dataclass(frozen=True)
class Budget:
    """How much device memory one rank may use, and where the number came from."""

    gib: float
    source: str  # e.g. "--gpu rtx3090", "planner.gpu_memory_gib", "detected NVIDIA A100-SXM4-80GB"
    gpu: GPU | None = None
    headroom: float = DEFAULT_HEADROOM

    @property
    def limit_gib(self) -> float:
        """What a plan may use and still be called `fits`."""
        return self.gib * (1.0 - self.headroom)


def verdict(total_gib: float, budget: Budget) -> str:
    """`fits`, `tight` or `does not fit` (see the module docstring)."""
    if total_gib <= budget.limit_gib:
        return "fits"
    if total_gib <= budget.gib:
        return "tight"
    return "does not fit"


def resolve_budget(
    cfg: ZerofitConfig, gpu: str | None = None, gpu_mem: str | float | None = None, detect: bool = True
) -> Budget | None:
    """The memory budget: CLI `--gpu-mem` / `--gpu`, then a detected CUDA device, then the config's planner
    section (`planner.gpu_memory_gib`, `planner.gpu`). None when nothing says how big the GPU is."""
    headroom = cfg.planner.headroom
    if gpu_mem is not None:
        return Budget(parse_memory_gib(gpu_mem), f"--gpu-mem {gpu_mem}", None, headroom)
    if gpu is not None:
        card = get_gpu(gpu)
        return Budget(card.memory_gib, f"--gpu {card.name}", card, headroom)
    if detect:
        found = detected_gpu()
        if found is not None:
            name, total = found
            return Budget(total, f"detected {name}", gpu_from_device_name(name, total), headroom)
    if cfg.planner.gpu_memory_gib is not None:
        return Budget(float(cfg.planner.gpu_memory_gib), "planner.gpu_memory_gib", None, headroom)
    if cfg.planner.gpu is not None:
        card = get_gpu(cfg.planner.gpu)
        return Budget(card.memory_gib, f"planner.gpu = {card.name}", card, headroom)
    return None
