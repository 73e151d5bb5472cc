"""Will it fit? The verdict for a GPU, the micro-batch table, `micro_batch_size=auto`, and remedies.

Everything here keeps the global batch fixed: a micro-batch size is a candidate only if it divides the
samples each rank processes per optimizer step (global / dp), so gradient accumulation stays whole and the
training is the same whichever candidate is chosen (docs/design.md: "one global batch").

Verdicts, for the card's usable memory M (torch's `total_memory`):
  - fits:          total (tensors + allowance) <= (1 - headroom) x M    (headroom: planner.headroom, 5%)
  - tight:         fits in M but inside the headroom: may OOM on an unlucky allocation pattern
  - does not fit:  total > M
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerofit.errors import ConfigError
from zerofit.planner.estimate import MemoryEstimate, estimate
from zerofit.planner.gpus import GPU, detected_gpu, get_gpu, gpu_from_device_name, parse_memory_gib
from zerofit.planner.scenario import Scenario, scenario_for, scenario_from_config

if TYPE_CHECKING:
    from zerofit.config.resolve import ResolvedConfig
    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine.spec import EngineSpec

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


def samples_per_rank(cfg: ZerofitConfig, world_size: int) -> int | None:
    """Samples each rank processes per optimizer step (global / dp), when the config fixes the global batch."""
    b = cfg.batch
    if b.global_batch_size is not None:
        if b.global_batch_size % world_size:
            return None
        return b.global_batch_size // world_size
    if isinstance(b.micro_batch_size, int) and b.grad_accum_steps:
        return b.micro_batch_size * b.grad_accum_steps
    return None


def divisors(n: int) -> list[int]:
    """All divisors of n, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@dataclass
class MicroRow:
    """One row of the micro-batch table."""

    micro_batch_size: int
    grad_accum_steps: int
    tensors_gib: float
    total_gib: float
    verdict: str | None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "tensors_gib": round(self.tensors_gib, 3),
            "total_gib": round(self.total_gib, 3),
            "verdict": self.verdict,
        }


@dataclass
class Remedy:
    """One way to make a run fit, with its predicted peak."""

    name: str
    how: str  # the overrides or launch change that applies it
    micro_batch_size: int
    total_gib: float
    verdict: str | None
    host_ram_gib: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "remedy": self.name,
            "how": self.how,
            "micro_batch_size": self.micro_batch_size,
            "total_gib": round(self.total_gib, 3),
            "verdict": self.verdict,
            "host_ram_gib": round(self.host_ram_gib, 1),
        }


@dataclass
class MemoryPlan:
    """Everything `zerofit plan` reports about memory for one config and budget."""

    estimate: MemoryEstimate
    budget: Budget | None
    verdict: str | None
    table: list[MicroRow] = field(default_factory=list)
    remedies: list[Remedy] = field(default_factory=list)
    auto_micro_batch_size: int | None = None

    @property
    def fits(self) -> bool | None:
        """True when the configured micro-batch fits with headroom (None without a budget)."""
        return None if self.verdict is None else self.verdict == "fits"

    def as_dict(self) -> dict[str, Any]:
        """The `memory` block of `zerofit plan --json`."""
        out = self.estimate.as_dict()
        out.update(
            {
                "fits": self.fits,
                "verdict": self.verdict,
                "gpu": None
                if self.budget is None
                else {
                    "name": self.budget.gpu.name if self.budget.gpu else None,
                    "memory_gib": round(self.budget.gib, 2),
                    "source": self.budget.source,
                    "headroom_fraction": self.budget.headroom,
                    "limit_gib": round(self.budget.limit_gib, 2),
                },
                "headroom_gib": None
                if self.budget is None
                else round(self.budget.gib - self.estimate.total_gib, 3),
                "micro_batch_table": [row.as_dict() for row in self.table],
                "auto_micro_batch_size": self.auto_micro_batch_size,
                "remedies": [r.as_dict() for r in self.remedies],
            }
        )
        return out


def micro_table(scn: Scenario, per_rank: int, budget: Budget | None) -> list[MicroRow]:
    """The predicted peak for every micro-batch size that divides the per-rank samples."""
    rows = []
    for m in divisors(per_rank):
        est = estimate(scn.with_micro(m, per_rank // m))
        rows.append(
            MicroRow(
                m,
                per_rank // m,
                est.tensors_gib,
                est.total_gib,
                verdict(est.total_gib, budget) if budget else None,
            )
        )
    return rows


def largest_fitting(table: list[MicroRow]) -> int | None:
    """The largest micro-batch size whose verdict is `fits` (None if none fits)."""
    fitting = [row.micro_batch_size for row in table if row.verdict == "fits"]
    return max(fitting) if fitting else None


def _remedy_candidates(cfg: ZerofitConfig, world_size: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, how, config changes) for every remedy that applies to `cfg`."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    if not cfg.train.activation_checkpointing:
        out.append(("activation checkpointing", "train.activation_checkpointing=true", {"ckpt": True}))
    if not cfg.lora.enabled:
        out.append(("LoRA instead of full fine-tuning", "lora.enabled=true", {"lora": True}))
    if cfg.optimizer.name == "adamw":
        out.append(("8-bit AdamW (bitsandbytes)", "optimizer.name=adamw_8bit", {"optimizer": "adamw_8bit"}))
    if cfg.quantization.load_in != "4bit":
        out.append(
            (
                "QLoRA: 4-bit base weights",
                "lora.enabled=true quantization.load_in=4bit distributed.strategy=single (one GPU) or deepspeed zero2",
                {
                    "lora": True,
                    "quant": "4bit",
                    "strategy": "single" if world_size == 1 else "deepspeed:zero2",
                },
            )
        )
    if not (cfg.distributed.strategy == "deepspeed" and (cfg.distributed.preset or "").endswith("offload")):
        out.append(
            (
                "offload to CPU (DeepSpeed ZeRO-3 offload)",
                "distributed.strategy=deepspeed distributed.preset=zero3_offload",
                {"strategy": "deepspeed:zero3_offload"},
            )
        )
    return out


def _apply(cfg: ZerofitConfig, changes: dict[str, Any]) -> ZerofitConfig:
    new = cfg.model_copy(deep=True)
    if changes.get("ckpt"):
        new.train.activation_checkpointing = True
    if changes.get("lora"):
        new.lora.enabled = True
    if "optimizer" in changes:
        new.optimizer.name = changes["optimizer"]
    if "quant" in changes:
        new.quantization.load_in = changes["quant"]
    if "strategy" in changes:
        strategy, _, preset = str(changes["strategy"]).partition(":")
        new.distributed.strategy = strategy  # type: ignore[assignment]
        new.distributed.preset = preset or None
        new.distributed.ds_config = None
    return new


def _best_micro(scn: Scenario, per_rank: int, budget: Budget) -> tuple[int, MemoryEstimate]:
    """The largest fitting micro-batch for `scn`, or micro 1 (the smallest peak) when none fits."""
    best_m, best = 1, estimate(scn.with_micro(1, per_rank))
    for m in divisors(per_rank)[1:]:
        est = estimate(scn.with_micro(m, per_rank // m))
        if verdict(est.total_gib, budget) != "fits":
            break
        best_m, best = m, est
    return best_m, best


def remedies(cfg: ZerofitConfig, world_size: int, budget: Budget) -> list[Remedy]:
    """Each remedy alone, then those that compose together, with the predicted peak at the best micro-batch;
    and the fewest GPUs (ZeRO-3) that make the unchanged run fit while dividing the global batch."""
    per_rank = samples_per_rank(cfg, world_size) or 1
    out: list[Remedy] = []
    combined: dict[str, Any] = {}
    applied: list[str] = []
    for name, how, changes in _remedy_candidates(cfg, world_size):
        scn = scenario_from_config(_apply(cfg, changes), world_size)
        m, est = _best_micro(scn, per_rank, budget)
        out.append(Remedy(name, how, m, est.total_gib, verdict(est.total_gib, budget), est.host_ram_gib))
        # Combine everything that composes; only one engine change (QLoRA's comes first) can apply.
        if "strategy" not in changes or "strategy" not in combined:
            combined.update(changes)
            applied.append(name)
    if len(applied) > 1:
        scn = scenario_from_config(_apply(cfg, combined), world_size)
        m, est = _best_micro(scn, per_rank, budget)
        how = " + ".join(applied)
        out.append(
            Remedy("combined", how, m, est.total_gib, verdict(est.total_gib, budget), est.host_ram_gib)
        )
    global_batch = cfg.batch.global_batch_size or per_rank * world_size
    for n in (2, 4, 8, 16, 32, 64):
        if n <= world_size or global_batch % n:
            continue
        sharded = _apply(cfg, {"strategy": "deepspeed:zero3"} if cfg.quantization.load_in == "none" else {})
        scn = scenario_from_config(sharded, n)
        m, est = _best_micro(scn, global_batch // n, budget)
        if verdict(est.total_gib, budget) == "fits":
            how = f"launch {n} ranks (e.g. deepspeed --num_gpus {n}) with distributed.preset=zero3"
            out.append(Remedy(f"more GPUs: {n} with ZeRO-3", how, m, est.total_gib, "fits", est.host_ram_gib))
            break
    return out


def plan_memory(resolved: ResolvedConfig, spec: EngineSpec, budget: Budget | None) -> MemoryPlan:
    """Estimate, verdict, micro-batch table and (when it does not fit) remedies for a resolved run."""
    cfg, world = resolved.config, resolved.world_size
    per_rank = spec.plan.samples_per_rank
    table = micro_table(scenario_for(resolved, spec, 1, per_rank), per_rank, budget)
    auto = largest_fitting(table) if budget is not None else None
    est = estimate(scenario_for(resolved, spec))
    result = MemoryPlan(
        est, budget, verdict(est.total_gib, budget) if budget else None, table, auto_micro_batch_size=auto
    )
    if budget is not None and result.verdict != "fits":
        result.remedies = remedies(cfg, world, budget)
    return result


def choose_auto_micro_batch(cfg: ZerofitConfig, world_size: int) -> int:
    """`batch.micro_batch_size=auto`: the largest micro-batch that fits AND divides global / dp.

    Raises `ConfigError` (with the table and the remedies) when no budget is known or nothing fits.
    """
    b = cfg.batch
    if b.global_batch_size is None:
        raise ConfigError(
            [
                "batch.micro_batch_size = 'auto' needs batch.global_batch_size (auto keeps the global batch and "
                "picks the largest micro-batch that fits and divides it); set batch.global_batch_size"
            ]
        )
    if b.grad_accum_steps is not None:
        raise ConfigError(
            [
                f"batch.micro_batch_size = 'auto' with batch.grad_accum_steps = {b.grad_accum_steps}: auto derives "
                "the accumulation from the micro-batch it picks; drop batch.grad_accum_steps"
            ]
        )
    per_rank = samples_per_rank(cfg, world_size)
    if per_rank is None:
        raise ConfigError(
            [
                f"batch.global_batch_size = {b.global_batch_size} is not divisible by the {world_size} data-parallel "
                "ranks; batch.micro_batch_size = 'auto' can only pick among divisors of global / dp"
            ]
        )
    budget = resolve_budget(cfg)
    if budget is None:
        raise ConfigError(
            [
                "batch.micro_batch_size = 'auto' needs the GPU's memory and no CUDA device is visible here: set "
                "planner.gpu (e.g. rtx3090) or planner.gpu_memory_gib (e.g. 24), or pass an integer micro-batch"
            ]
        )
    table = micro_table(scenario_from_config(cfg, world_size, 1, per_rank), per_rank, budget)
    chosen = largest_fitting(table)
    if chosen is None:
        smallest = table[0]
        lines = [
            f"batch.micro_batch_size = 'auto': not even micro-batch 1 fits {budget.source} "
            f"({budget.gib:.1f} GiB, {budget.headroom:.0%} headroom): predicted {smallest.total_gib:.1f} GiB. Remedies:"
        ]
        for r in remedies(cfg, world_size, budget):
            lines.append(
                f"    {r.name}: {r.total_gib:.1f} GiB at micro {r.micro_batch_size} ({r.verdict}) - {r.how}"
            )
        raise ConfigError(["\n".join(lines)])
    return chosen
