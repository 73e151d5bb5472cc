"""Will it fit? The verdict for a GPU, the micro-batch table, `micro_batch_size=auto`, and remedies.

Everything here keeps the global batch fixed: a micro-batch size is a candidate only if it divides the
samples each rank processes per optimizer step (global / dp), so gradient accumulation stays whole and the
training is the same whichever candidate is chosen (docs/design.md: "one global batch").

The fastest plan: every (micro-batch, checkpointed layers) pair that fits is scored by the cost model of
`speed.py` (recomputation FLOPs per checkpointed layer against the per-micro-step overhead a bigger
micro-batch amortizes); for each micro-batch the fewest checkpointed layers that fit is the fastest, and
the best micro-batch wins. `auto` keys (`batch.micro_batch_size`, `batch.tokens_per_micro_batch`,
`train.activation_checkpointing`) take that plan. `train.tiled_mlp` / `train.activation_offload` /
`train.lean_norm` = `auto` add their settings as variants (`lever_variants`): a lever costs time (speed.py), so it is chosen only
where it makes a plan fit or lets a faster one fit (a tie keeps it off).

Verdicts, for the card's usable memory M (torch's `total_memory`):
  - fits:          total (tensors + allowance) <= (1 - headroom) x M    (headroom: planner.headroom, 5%)
  - tight:         fits in M but inside the headroom: may OOM on an unlucky allocation pattern
  - does not fit:  total > M
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from zerofit.config.resolve import PlanChoice, data_parallel_size, micro_batch_setting
from zerofit.engine.user_ds_config import pinned_split_problems
from zerofit.errors import ConfigError
from zerofit.planner.estimate import MemoryEstimate, estimate
from zerofit.planner.gpus import GPU, detected_gpu, get_gpu, gpu_from_device_name, parse_memory_gib
from zerofit.planner.scenario import TILED_MLP_SHARDS, Scenario, scenario_for, what_if
from zerofit.planner.shapes import model_shape
from zerofit.planner.speed import SpeedEstimate, predict_speed, speed_levers
from zerofit.recompute import describe_checkpointing

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
    """Samples each rank processes per optimizer step (global / dp), when the config fixes the global batch
    (dp = world / `distributed.sequence_parallel`: a sequence-parallel group processes one rank's share)."""
    b, dp = cfg.batch, data_parallel_size(cfg, world_size)
    if b.global_batch_size is not None:
        if b.global_batch_size % dp:
            return None
        return b.global_batch_size // dp
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
    speed: SpeedPlan | None = None

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
                "speed": None if self.speed is None else self.speed.as_dict(),
            }
        )
        return out


@dataclass
class SpeedPlan:
    """The fastest plans under the budget (one per micro-batch, fastest first), the configured plan, and the
    baseline the speed-up is measured against (`baseline_option`)."""

    options: list[PlanOption]
    configured: PlanOption
    baseline: PlanOption | None
    # What the speed model assumed for the opt-in speed levers that are on (`speed.speed_levers`), or None.
    speed_levers: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The `memory.speed` block of `zerofit plan --json`."""
        chosen = self.options[0] if self.options else None
        runner_up = self.options[1] if len(self.options) > 1 else None
        base = self.baseline.speed.tokens_per_s if self.baseline else None
        return {
            "model": "t_micro = overhead + tokens x FLOPs/token (recompute included) / sustained rate",
            "rates_of": self.configured.speed.gpu,
            "reference_rates": self.configured.speed.reference,
            "chosen": chosen.as_dict() if chosen else None,
            "runner_up": runner_up.as_dict() if runner_up else None,
            "configured": self.configured.as_dict(),
            "baseline": self.baseline.as_dict() if self.baseline else None,
            "speedup_vs_baseline": round(chosen.speed.tokens_per_s / base, 3) if chosen and base else None,
            "configured_vs_baseline": round(self.configured.speed.tokens_per_s / base, 3) if base else None,
            "options": [o.as_dict() for o in self.options],
            "speed_levers": self.speed_levers,
        }


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


@dataclass
class PlanOption:
    """One (micro-batch, checkpointed decoder layers) pair: its predicted memory and speed."""

    micro_batch_size: int
    grad_accum_steps: int
    checkpointed_layers: int
    num_layers: int
    tensors_gib: float
    total_gib: float
    verdict: str | None
    speed: SpeedEstimate
    tiled_mlp: int = 1  # MLP token shards (1 = off)
    activation_offload: bool = False
    lean_norm: bool = False
    cross_entropy: str = "chunked"

    @property
    def checkpointing(self) -> bool | int:
        """The `train.activation_checkpointing` value of this option (true, false or a layer count)."""
        if self.checkpointed_layers >= self.num_layers:
            return True
        return self.checkpointed_layers or False

    def describe(self) -> str:
        """E.g. `micro 8 x accum 4, checkpointing first 12 of 32 layers` (+ the levers it uses)."""
        ckpt = describe_checkpointing(self.checkpointed_layers, self.num_layers)
        out = f"micro {self.micro_batch_size} x accum {self.grad_accum_steps}, checkpointing {ckpt}"
        if self.tiled_mlp > 1:
            out += f", MLP in {self.tiled_mlp} token shards"
        out += ", inputs offloaded to host" if self.activation_offload else ""
        out += ", lean RMSNorms" if self.lean_norm else ""
        return out + (", the loss inside lm_head" if self.cross_entropy == "fused_linear" else "")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (the levers' keys only where the option uses them)."""
        out = {
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "checkpointed_layers": self.checkpointed_layers,
            "num_layers": self.num_layers,
            "tensors_gib": round(self.tensors_gib, 3),
            "total_gib": round(self.total_gib, 3),
            "verdict": self.verdict,
            "tokens_per_s": round(self.speed.tokens_per_s, 1),
            "step_time_s": round(self.speed.step_time_s, 3),
            "recompute_fraction": round(self.speed.recompute_fraction, 4),
        }
        if self.tiled_mlp > 1:
            out["tiled_mlp"] = self.tiled_mlp
        if self.activation_offload:
            out["activation_offload"] = True
        if self.lean_norm:
            out["lean_norm"] = True
        if self.cross_entropy == "fused_linear":
            out["cross_entropy"] = "fused_linear"
        return out


def plan_option(scn: Scenario, budget: Budget | None) -> PlanOption:
    """Memory and speed of one scenario as a plan option."""
    layers = model_shape(scn.model).num_layers
    est = estimate(scn)
    return PlanOption(
        micro_batch_size=scn.micro_batch_size,
        grad_accum_steps=scn.grad_accum_steps,
        checkpointed_layers=scn.checkpointed(layers),
        num_layers=layers,
        tensors_gib=est.tensors_gib,
        total_gib=est.total_gib,
        verdict=verdict(est.total_gib, budget) if budget else None,
        speed=predict_speed(scn, budget.gpu if budget else None),
        tiled_mlp=scn.tiled_mlp,
        activation_offload=scn.activation_offload,
        lean_norm=scn.lean_norm,
        cross_entropy=scn.cross_entropy,
    )


def fastest_options(
    scn: Scenario, per_rank: int, budget: Budget, micros: list[int] | None = None, layers: int | None = None
) -> list[PlanOption]:
    """For each micro-batch (`micros`, default every divisor of `per_rank`): the option with the fewest
    checkpointed layers that fits (or exactly `layers` checkpointed, when given), fastest first.

    Fewer checkpointed layers is always faster at a given micro-batch (less recomputation), and the peak
    only grows as layers stop being checkpointed, so the scan stops at the first fitting count.
    """
    num_layers = model_shape(scn.model).num_layers
    # Offload needs checkpointing: at least one checkpointed layer.
    counts = [layers] if layers is not None else list(range(int(scn.activation_offload), num_layers + 1))
    options = []
    for m in micros if micros is not None else divisors(per_rank):
        at_micro = scn.with_micro(m, per_rank // m)
        for n in counts:
            option = plan_option(at_micro.with_checkpointing(n), budget)
            if option.verdict == "fits":
                options.append(option)
                break
    return sorted(options, key=lambda o: -o.speed.tokens_per_s)


def baseline_option(scn: Scenario, per_rank: int, budget: Budget) -> PlanOption | None:
    """Full checkpointing at the largest micro-batch that fits: what `auto` picked before selective
    checkpointing and the chunked loss (the reference for the predicted speed-up)."""
    full = scn.with_checkpointing(True)
    if scn.cross_entropy == "chunked":
        full = replace(full, cross_entropy="unchunked")
    fitting = fastest_options(full, per_rank, budget, layers=model_shape(scn.model).num_layers)
    return max(fitting, key=lambda o: o.micro_batch_size) if fitting else None


@dataclass(frozen=True)
class _Candidate:
    """A remedy before it is estimated: its name and the overrides that apply it (parsed by the config
    loader, the same parser as the command line). What the user is shown is those overrides, unless
    `choice` says it in words (a remedy whose engine depends on the GPU count)."""

    name: str
    overrides: tuple[str, ...]
    choice: str | None = None

    @property
    def how(self) -> str:
        """The overrides as the user types them (the implied `distributed.ds_config=null` left out)."""
        return self.choice or " ".join(o for o in self.overrides if o != _NO_DS_CONFIG)

    @property
    def changes_engine(self) -> bool:
        """True when the remedy picks a distributed strategy (only one such remedy can combine)."""
        return any(o.startswith("distributed.strategy=") for o in self.overrides)


_NO_DS_CONFIG = "distributed.ds_config=null"


def _remedy_candidates(cfg: ZerofitConfig, world_size: int) -> list[_Candidate]:
    """Every remedy that applies to `cfg`."""
    out: list[_Candidate] = []
    if cfg.train.activation_checkpointing is not True:
        out.append(_Candidate("activation checkpointing", ("train.activation_checkpointing=true",)))
    if not cfg.lora.enabled:
        out.append(_Candidate("LoRA instead of full fine-tuning", ("lora.enabled=true",)))
    if cfg.optimizer.name == "adamw":
        out.append(_Candidate("8-bit AdamW (bitsandbytes)", ("optimizer.name=adamw_8bit",)))
    if cfg.quantization.load_in != "4bit":
        one_gpu = world_size == 1
        engine = _engine_overrides("single" if one_gpu else "deepspeed", None if one_gpu else "zero2")
        choice = "lora.enabled=true quantization.load_in=4bit distributed.strategy=single (one GPU) or deepspeed zero2"
        overrides = ("lora.enabled=true", "quantization.load_in=4bit", *engine)
        out.append(_Candidate("QLoRA: 4-bit base weights", overrides, choice))
    if not (cfg.distributed.strategy == "deepspeed" and (cfg.distributed.preset or "").endswith("offload")):
        offload = _engine_overrides("deepspeed", "zero3_offload")
        out.append(_Candidate("offload to CPU (DeepSpeed ZeRO-3 offload)", offload))
    return out


def _engine_overrides(strategy: str, preset: str | None) -> tuple[str, ...]:
    """Overrides that switch the engine, dropping any user DeepSpeed file (the preset decides instead)."""
    return (
        f"distributed.strategy={strategy}",
        f"distributed.preset={preset or 'null'}",
        _NO_DS_CONFIG,
    )


def _best_micro(scn: Scenario, per_rank: int, budget: Budget) -> tuple[int, MemoryEstimate]:
    """The largest fitting micro-batch for `scn`, or micro 1 (the smallest peak) when none fits."""
    best_m, best = 1, estimate(scn.with_micro(1, per_rank))
    for m in divisors(per_rank)[1:]:
        est = estimate(scn.with_micro(m, per_rank // m))
        if verdict(est.total_gib, budget) != "fits":
            break
        best_m, best = m, est
    return best_m, best


def _what_if(
    cfg: ZerofitConfig,
    world_size: int,
    overrides: Iterable[str],
    micro: int | None = None,
    accum: int | None = None,
) -> Scenario | None:
    """`what_if`'s scenario, or None where `resolve()` refuses the what-if (then it is no remedy)."""
    try:
        return what_if(cfg, world_size, overrides, micro, accum)
    except ConfigError:
        return None


def _remedy(name: str, how: str, scn: Scenario, per_rank: int, budget: Budget) -> Remedy:
    """A remedy at its best micro-batch (`_best_micro`)."""
    m, est = _best_micro(scn, per_rank, budget)
    return Remedy(name, how, m, est.total_gib, verdict(est.total_gib, budget), est.host_ram_gib)


def remedies(cfg: ZerofitConfig, world_size: int, budget: Budget) -> list[Remedy]:
    """Each remedy alone, then those that compose together, with the predicted peak at the best micro-batch;
    and the fewest GPUs (ZeRO-3) that make the unchanged run fit while dividing the global batch. Each is
    the run `resolve()` makes of the config with the remedy's overrides (`what_if`)."""
    per_rank = samples_per_rank(cfg, world_size) or 1
    out: list[Remedy] = []
    combined: list[str] = []
    applied: list[str] = []
    engine_changed = False
    for cand in _remedy_candidates(cfg, world_size):
        scn = _what_if(cfg, world_size, cand.overrides)
        if scn is None:
            continue
        out.append(_remedy(cand.name, cand.how, scn, per_rank, budget))
        # Combine everything that composes; only one engine change (QLoRA's comes first) can apply.
        if not (cand.changes_engine and engine_changed):
            combined.extend(o for o in cand.overrides if o not in combined)
            applied.append(cand.name)
            engine_changed = engine_changed or cand.changes_engine
    if len(applied) > 1:
        scn = _what_if(cfg, world_size, combined)
        if scn is not None:
            out.append(_remedy("combined", " + ".join(applied), scn, per_rank, budget))
    levers = _lever_remedy(cfg, world_size, per_rank, budget)
    out += [levers] if levers is not None else []
    global_batch = cfg.batch.global_batch_size or per_rank * world_size
    if world_size >= 2:  # the ranks launched can share each sequence: no more GPUs needed
        shared = _sequence_parallel_at(cfg, world_size, budget, global_batch, launched=True)
        out += [shared] if shared is not None else []
    more = _more_gpus(cfg, world_size, budget, global_batch)
    return out + ([more] if more is not None else [])


def _lever_remedy(cfg: ZerofitConfig, world_size: int, per_rank: int, budget: Budget) -> Remedy | None:
    """The long-context levers as one remedy: of the combinations `zerofit plan --max-context` weighs
    (activation offload, tiled MLP, the fused loss, the lean RMSNorm, QLoRA's bf16 residual; every layer
    checkpointed), the fastest that makes this run fit at micro-batch 1, as the overrides that change the
    config. None where none fits or none changes anything. They keep the model and the engine, so they
    are offered on their own, not combined with the other remedies."""
    from zerofit.planner.context import needed_overrides

    found = _fastest_levers(cfg, world_size, (), per_rank, budget)
    if found is None:
        return None
    overrides, scn = found
    how = " ".join(needed_overrides(overrides, cfg))
    return _remedy("long-context levers", how, scn, per_rank, budget) if how else None


def _fastest_levers(
    cfg: ZerofitConfig, n: int, overrides: tuple[str, ...], per_rank: int, budget: Budget
) -> tuple[tuple[str, ...], Scenario] | None:
    """Of the long-context lever combinations `--max-context` weighs, the fastest that makes `overrides` on
    `n` ranks fit at micro-batch 1 (its lever overrides and scenario), or None where none fits."""
    from zerofit.planner.context import lever_combinations

    combos = lever_combinations(cfg)
    # The last combination saves the most (every lever on, the most MLP shards): where it does not fit,
    # none does, and the other what-ifs are skipped (remedies run this for every size of every GPU count).
    most = _what_if(cfg, n, (*overrides, *combos[-1]), 1, per_rank)
    if most is None or verdict(estimate(most).total_gib, budget) != "fits":
        return None
    fitting = []
    for levers in combos:
        scn = _what_if(cfg, n, (*overrides, *levers), 1, per_rank)
        if scn is not None and verdict(estimate(scn).total_gib, budget) == "fits":
            fitting.append((levers, scn))
    # Fewest levers first in the list: among equally fast combinations the first one is kept.
    return max(fitting, key=lambda c: predict_speed(c[1], budget.gpu).tokens_per_s)


def _more_gpus(cfg: ZerofitConfig, world_size: int, budget: Budget, global_batch: int) -> Remedy | None:
    """The fewest GPUs that make the run fit, or None: data-parallel (sharded by ZeRO-3 unless the base is
    quantized) where they divide the global batch, else with the sequence shared by some of them (Ulysses,
    `_sequence_parallel_at`): more data-parallel ranks never shorten the sequence one rank holds."""
    engine = _engine_overrides("deepspeed", "zero3") if cfg.quantization.load_in == "none" else ()
    for n in (2, 4, 8, 16, 32, 64):
        if n <= world_size:
            continue
        scn = None if global_batch % n else _what_if(cfg, n, engine, 1, global_batch // n)
        if scn is not None:
            m, est = _best_micro(scn, global_batch // n, budget)
            if verdict(est.total_gib, budget) == "fits":
                how = f"launch {n} ranks (e.g. deepspeed --num_gpus {n}) with distributed.preset=zero3"
                return Remedy(f"more GPUs: {n} with ZeRO-3", how, m, est.total_gib, "fits", est.host_ram_gib)
        shared = _sequence_parallel_at(cfg, n, budget, global_batch)
        if shared is not None:
            return shared
    return None


def _sequence_parallel_at(
    cfg: ZerofitConfig, n: int, budget: Budget, global_batch: int, launched: bool = False
) -> Remedy | None:
    """Ulysses sequence parallelism on `n` ranks (`distributed.sequence_parallel`, DeepSpeed): the smallest
    size above the config's that divides `n`, keeps dp = n / size dividing the global batch and makes the
    run fit (with the long-context levers where it needs them, `_fit_with_levers`), on the config's
    DeepSpeed engine if it has one, else ZeRO-3 (ZeRO-2 for a quantized base); None where none fits or
    `resolve()` refuses it (head counts, packing, a preference objective, eager attention). `launched`: `n`
    is the world the config is planned for (no launch change to show)."""
    for sp in (d for d in divisors(n) if d > cfg.distributed.sequence_parallel):
        if global_batch % (n // sp):
            continue
        for engine in _sequence_parallel_engines(cfg):
            found = _fit_with_levers(
                cfg, n, (*engine, f"distributed.sequence_parallel={sp}"), global_batch // (n // sp), budget
            )
            if found is None:
                continue
            levers, m, est = found
            shown = [o for o in engine if o not in (_NO_DS_CONFIG, "distributed.strategy=deepspeed")]
            if cfg.distributed.strategy != "deepspeed":
                shown.insert(0, "distributed.strategy=deepspeed")
            change = " ".join([*shown, f"distributed.sequence_parallel={sp}", *levers])
            how = change if launched else f"launch {n} ranks (e.g. deepspeed --num_gpus {n}) with {change}"
            name = f"sequence parallelism: {sp} of the {n} GPUs share each sequence"
            if not launched:
                name = f"more GPUs: {n} with sequence parallelism {sp}"
            return Remedy(name, how, m, est.total_gib, "fits", est.host_ram_gib)
    return None


def _fit_with_levers(
    cfg: ZerofitConfig, n: int, overrides: tuple[str, ...], per_rank: int, budget: Budget
) -> tuple[list[str], int, MemoryEstimate] | None:
    """`overrides` on `n` ranks at its best micro-batch when that fits, else with the fastest fitting
    combination of the long-context levers at micro 1 (`_fastest_levers`): the lever overrides that change
    the config, the micro-batch and the estimate; None where nothing fits (or `resolve()` refuses it)."""
    from zerofit.planner.context import needed_overrides

    scn = _what_if(cfg, n, overrides, 1, per_rank)
    if scn is None:
        return None
    m, est = _best_micro(scn, per_rank, budget)
    if verdict(est.total_gib, budget) == "fits":
        return [], m, est
    found = _fastest_levers(cfg, n, overrides, per_rank, budget)
    if found is None:
        return None
    levers, scn = found
    return needed_overrides(levers, cfg), 1, estimate(scn)


def _sequence_parallel_engines(cfg: ZerofitConfig) -> list[tuple[str, ...]]:
    """The engines a sequence-parallel remedy tries, in order: the config's own DeepSpeed one (no override),
    then ZeRO-3, which also shards the base weights over the ranks (ZeRO-2 for a quantized base)."""
    preset = "zero3" if cfg.quantization.load_in == "none" else "zero2"
    out: list[tuple[str, ...]] = []
    if cfg.distributed.strategy == "deepspeed":
        out.append(())
    if not (cfg.distributed.strategy == "deepspeed" and cfg.distributed.preset == preset):
        out.append(_engine_overrides("deepspeed", preset))
    return out


def plan_memory(resolved: ResolvedConfig, spec: EngineSpec, budget: Budget | None) -> MemoryPlan:
    """Estimate, verdict, micro-batch table, the fastest plans and (when it does not fit) remedies."""
    cfg, world = resolved.config, resolved.world_size
    per_rank = spec.plan.samples_per_rank
    configured = scenario_for(cfg, spec)
    table = micro_table(scenario_for(cfg, spec, 1, per_rank), per_rank, budget)
    auto = largest_fitting(table) if budget is not None else None
    est = estimate(configured)
    result = MemoryPlan(
        est, budget, verdict(est.total_gib, budget) if budget else None, table, auto_micro_batch_size=auto
    )
    if budget is not None:
        result.speed = SpeedPlan(
            options=fastest_options(configured, per_rank, budget),
            configured=plan_option(configured, budget),
            baseline=baseline_option(configured, per_rank, budget),
            speed_levers=speed_levers(configured),
        )
        if result.verdict != "fits":
            result.remedies = remedies(cfg, world, budget)
    return result


def _budget_for_auto(cfg: ZerofitConfig, keys: str) -> Budget:
    budget = resolve_budget(cfg)
    if budget is None:
        raise ConfigError(
            [
                f"{keys} = 'auto' needs the GPU's memory and no CUDA device is visible here: set planner.gpu (e.g. "
                "rtx3090) or planner.gpu_memory_gib (e.g. 24), or give a value instead of auto"
            ]
        )
    return budget


def _nothing_fits(
    cfg: ZerofitConfig, world_size: int, budget: Budget, what: str, smallest: str, total_gib: float
) -> ConfigError:
    lines = [
        f"{what}: not even {smallest} fits {budget.source} ({budget.gib:.1f} GiB, {budget.headroom:.0%} "
        f"headroom): predicted {total_gib:.1f} GiB. Remedies:"
    ]
    for r in remedies(cfg, world_size, budget):
        lines.append(
            f"    {r.name}: {r.total_gib:.1f} GiB at micro {r.micro_batch_size} ({r.verdict}) - {r.how}"
        )
    return ConfigError(["\n".join(lines)])


def choose_plan(cfg: ZerofitConfig, world_size: int) -> PlanChoice:
    """Decide the `auto` keys: the fastest (micro-batch, checkpointed layers) that fits, keeping the global
    batch (the micro-batch divides global / dp). `batch.micro_batch_size` may be the rows of a token budget.

    - micro auto, checkpointing fixed: the largest micro-batch that fits;
    - micro fixed, checkpointing auto: the fewest checkpointed layers that fit at that micro-batch;
    - both auto: the pair with the highest predicted tokens/s (`speed.py`);
    - `train.tiled_mlp` / `train.activation_offload` / `train.lean_norm` auto: the fastest of their
      settings (`lever_variants`).
    Raises `ConfigError` (with the remedies) when no budget is known or nothing fits.
    """
    b = cfg.batch
    micro = micro_batch_setting(cfg)
    micro_key = (
        "batch.tokens_per_micro_batch" if b.tokens_per_micro_batch is not None else "batch.micro_batch_size"
    )
    keys = " and ".join([micro_key] * (micro == "auto") + _auto_names(cfg))
    per_rank = _auto_samples_per_rank(cfg, world_size, micro_key) if micro == "auto" else None
    if micro != "auto" and b.global_batch_size:
        per_rank = samples_per_rank(cfg, world_size)
    # The loss alone is auto (the rest fixed): where it cannot be weighed, the default, as without auto.
    only_loss = isinstance(micro, int) and _auto_names(cfg) == ["train.cross_entropy"]
    if only_loss and resolve_budget(cfg) is None:
        assert isinstance(micro, int)
        return _default_loss(cfg, micro, NO_BUDGET_FOR_THE_LOSS)
    budget = _budget_for_auto(cfg, keys)
    pinned = pinned_split_problems(cfg)  # a user's DeepSpeed file may not pin the split auto chooses
    if pinned:
        raise ConfigError(pinned)
    scn = what_if(cfg, world_size, micro_batch_size=1, grad_accum_steps=per_rank or 1)
    if micro == "auto":
        assert per_rank is not None
        return _choose_micro(cfg, world_size, scn, per_rank, budget, keys)
    assert isinstance(micro, int)
    try:
        return _choose_checkpointing(cfg, world_size, scn, micro, per_rank, budget)
    except ConfigError:
        if not only_loss:
            raise
        return _default_loss(cfg, micro, "the plan fits neither with nor without the logits; the default")


def _auto_samples_per_rank(cfg: ZerofitConfig, world_size: int, micro_key: str) -> int:
    """Samples per rank for an `auto` micro-batch, which needs a global batch that dp divides and no fixed
    accumulation (auto derives it from the micro-batch it picks)."""
    b = cfg.batch
    if b.global_batch_size is None:
        raise ConfigError(
            [
                f"{micro_key} = 'auto' needs batch.global_batch_size (auto keeps the global batch and picks "
                "the largest micro-batch that fits and divides it); set batch.global_batch_size"
            ]
        )
    if b.grad_accum_steps is not None:
        raise ConfigError(
            [
                f"{micro_key} = 'auto' with batch.grad_accum_steps = {b.grad_accum_steps}: auto derives the "
                "accumulation from the micro-batch it picks; drop batch.grad_accum_steps"
            ]
        )
    per_rank = samples_per_rank(cfg, world_size)
    if per_rank is None:
        raise ConfigError(
            [
                f"batch.global_batch_size = {b.global_batch_size} is not divisible by the {world_size} data-parallel "
                f"ranks; {micro_key} = 'auto' can only pick among divisors of global / dp"
            ]
        )
    return per_rank


def lever_variants(cfg: ZerofitConfig, scn: Scenario) -> list[Scenario]:
    """`scn` with every combination of the `auto` levers' settings (`train.tiled_mlp`,
    `train.activation_offload`, `train.lean_norm`), the levers-off one first (ties keep it). Offload only
    where some layer can be checkpointed (`resolve()` refuses it otherwise)."""
    t = cfg.train
    shards = TILED_MLP_SHARDS if t.tiled_mlp == "auto" else (scn.tiled_mlp,)
    offload: tuple[bool, ...] = (scn.activation_offload,)
    if t.activation_offload == "auto":
        offload = (False, True) if t.activation_checkpointing not in (False, 0) else (False,)
    lean = (scn.lean_norm,)
    if t.lean_norm == "auto":
        from zerofit.planner.context import lean_norm_applies

        lean = (False, True) if lean_norm_applies(scn.model) else (False,)
    losses = (scn.cross_entropy,)
    if t.cross_entropy == "auto":
        from zerofit.planner.context import fused_loss_refusal

        losses = ("chunked",) if fused_loss_refusal(cfg) else ("chunked", "fused_linear")
    return [
        scn.with_levers(tiled_mlp=s, activation_offload=o, lean_norm=n, cross_entropy=c)
        for c in losses
        for n in lean
        for o in offload
        for s in shards
    ]


def _plan_choice(cfg: ZerofitConfig, best: PlanOption) -> PlanChoice:
    """The chosen option as the values of the `auto` keys (the others keep the config's)."""
    t = cfg.train
    checkpointing = best.checkpointing if t.activation_checkpointing == "auto" else t.activation_checkpointing
    return PlanChoice(
        best.micro_batch_size,
        checkpointing,  # type: ignore[arg-type]
        tiled_mlp=best.tiled_mlp if best.tiled_mlp > 1 else False,
        activation_offload=best.activation_offload,
        lean_norm=best.lean_norm,
        cross_entropy=best.cross_entropy,
        loss_reason=_loss_reason(cfg, best),
    )


def _loss_reason(cfg: ZerofitConfig, best: PlanOption) -> str:
    """Why `train.cross_entropy: auto` became the chosen option's loss (the plan's note)."""
    if cfg.train.cross_entropy != "auto":
        return ""
    from zerofit.planner.context import fused_loss_refusal

    refusal = fused_loss_refusal(cfg)
    if refusal:
        return f"the fused loss does not apply here ({refusal})"
    if best.cross_entropy == "fused_linear":
        return "without the logits the plan fits, or a faster one does (the fused loss is exact: the same token sums)"
    return "the plan fits with the logits and is fastest so (the fused loss costs one more lm_head matmul)"


NO_BUDGET_FOR_THE_LOSS = (
    "no GPU memory budget is known here (planner.gpu, planner.gpu_memory_gib or a CUDA device) to weigh the "
    "fused loss against, so the default"
)


def _default_loss(cfg: ZerofitConfig, micro: int, why: str) -> PlanChoice:
    """`train.cross_entropy: auto` as the only `auto` key, where the planner cannot weigh it (no GPU budget
    known, or nothing fits either way): the default loss and the configured plan, as without auto."""
    t = cfg.train
    return PlanChoice(
        micro, t.activation_checkpointing, t.tiled_mlp, t.activation_offload, t.lean_norm, "chunked", why
    )  # type: ignore[arg-type]


def _choose_micro(
    cfg: ZerofitConfig, world_size: int, scn: Scenario, per_rank: int, budget: Budget, keys: str
) -> PlanChoice:
    """An `auto` micro-batch: the fastest fitting plan when checkpointing is auto too, else the largest
    micro-batch that fits at the configured checkpointing (the fastest among the lever variants there)."""
    t = cfg.train
    fixed_layers = (
        None if t.activation_checkpointing == "auto" else scn.checkpointed(model_shape(scn.model).num_layers)
    )
    options = [
        o for v in lever_variants(cfg, scn) for o in fastest_options(v, per_rank, budget, layers=fixed_layers)
    ]
    # Stable sorts: among equals the earlier variant (levers off) stays first.
    options.sort(key=lambda o: -o.speed.tokens_per_s)
    if fixed_layers is not None:
        options.sort(key=lambda o: -o.micro_batch_size)  # largest micro-batch (the fastest too)
    if not options:
        at_one = scn if fixed_layers is not None else scn.with_checkpointing(True)
        what = "micro-batch 1" + ("" if fixed_layers is not None else " with every layer checkpointed")
        raise _nothing_fits(cfg, world_size, budget, f"{keys} = 'auto'", what, estimate(at_one).total_gib)
    return _plan_choice(cfg, options[0])


def _choose_checkpointing(
    cfg: ZerofitConfig, world_size: int, scn: Scenario, micro: int, per_rank: int | None, budget: Budget
) -> PlanChoice:
    """A fixed micro-batch: the fastest lever variant that fits, with the fewest checkpointed layers that
    fit where checkpointing is `auto` (else the configured checkpointing)."""
    per = per_rank if per_rank is not None and per_rank % micro == 0 else micro
    t = cfg.train
    fixed_layers = (
        None if t.activation_checkpointing == "auto" else scn.checkpointed(model_shape(scn.model).num_layers)
    )
    options = [
        o
        for v in lever_variants(cfg, scn)
        for o in fastest_options(v, per, budget, micros=[micro], layers=fixed_layers)
    ]
    options.sort(key=lambda o: -o.speed.tokens_per_s)
    if not options:
        full = estimate(scn.with_micro(micro, per // micro).with_checkpointing(True)).total_gib
        raise _nothing_fits(
            cfg, world_size, budget, " and ".join(_auto_names(cfg)) + " = 'auto'",
            f"checkpointing every layer at micro {micro}", full,
        )  # fmt: skip
    return _plan_choice(cfg, options[0])


def _auto_names(cfg: ZerofitConfig) -> list[str]:
    """The training keys set to `auto` (for messages)."""
    t = cfg.train
    keys = ("activation_checkpointing", "tiled_mlp", "activation_offload", "lean_norm", "cross_entropy")
    return [f"train.{k}" for k in keys if getattr(t, k) == "auto"]
