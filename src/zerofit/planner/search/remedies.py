"""What to change when the config does not fit: another engine or preset, the memory levers, more GPUs,
sequence parallelism; each a what-if resolved like the config itself, with the micro-batch that fits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerofit.core.errors import ConfigError
from zerofit.planner.estimate import MemoryEstimate, estimate
from zerofit.planner.scenario import Scenario, what_if
from zerofit.planner.search.budget import Budget, verdict
from zerofit.planner.search.table import divisors, samples_per_rank
from zerofit.planner.speed import predict_speed

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


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
