"""What to change when the config does not fit: a smaller micro-batch, another engine or preset, the memory
levers, more GPUs, sequence parallelism; each a what-if resolved like the config itself, at the configured
micro-batch where it fits there (else the largest that fits, the micro-batch change then part of it), with
its cost in words. The smallest change comes first: where the micro-batch alone makes the run fit, the
other remedies are kept only where they fit a larger micro-batch than it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerofit.config.rules.batch import micro_batch_setting
from zerofit.core.errors import ConfigError
from zerofit.planner.estimate import MemoryEstimate, estimate
from zerofit.planner.scenario import Scenario, what_if
from zerofit.planner.search.budget import Budget, verdict
from zerofit.planner.search.table import divisors, samples_per_rank
from zerofit.planner.speed import KBIT_SLOWDOWN, predict_speed

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


@dataclass
class Remedy:
    """One way to make a run fit, with its predicted peak and what it costs."""

    name: str
    how: str  # the overrides or launch change that applies it, the micro-batch change included
    micro_batch_size: int
    total_gib: float
    verdict: str | None
    host_ram_gib: float = 0.0
    cost: str = ""  # what the change costs besides memory, in words (stated once, here)

    @property
    def changes(self) -> int:
        """How many keys the remedy changes (a launch on more GPUs counts as one more): its size."""
        return sum("=" in word for word in self.how.split()) + self.how.startswith("launch ")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "remedy": self.name,
            "how": self.how,
            "micro_batch_size": self.micro_batch_size,
            "total_gib": round(self.total_gib, 3),
            "verdict": self.verdict,
            "host_ram_gib": round(self.host_ram_gib, 1),
            "cost": self.cost,
        }


@dataclass(frozen=True)
class _Candidate:
    """A remedy before it is estimated: its name, the overrides that apply it (parsed by the config loader,
    the same parser as the command line) and its cost (`{host_ram_gib}` is filled with its host RAM)."""

    name: str
    overrides: tuple[str, ...]
    cost: str

    @property
    def how(self) -> str:
        """The overrides as the user types them (the implied `distributed.ds_config=null` left out)."""
        return _typed(self.overrides)

    @property
    def changes_engine(self) -> bool:
        """True when the remedy picks a distributed strategy (only one such remedy can combine)."""
        return any(o.startswith("distributed.strategy=") for o in self.overrides)


_NO_DS_CONFIG = "distributed.ds_config=null"


def _typed(overrides: Iterable[str]) -> str:
    """Overrides as the user types them: the implied `distributed.ds_config=null` left out."""
    return " ".join(o for o in overrides if o != _NO_DS_CONFIG)


def _remedy_candidates(cfg: ZerofitConfig, world_size: int) -> list[_Candidate]:
    """Every remedy that applies to `cfg`."""
    out: list[_Candidate] = []
    if cfg.train.activation_checkpointing is not True:
        recompute = "recomputes every layer's forward in backward"
        out.append(
            _Candidate("activation checkpointing", ("train.activation_checkpointing=true",), recompute)
        )
    if not cfg.lora.enabled:
        lora = "trains low-rank adapters, not every weight"
        out.append(_Candidate("LoRA instead of full fine-tuning", ("lora.enabled=true",), lora))
    if cfg.optimizer.name == "adamw":
        adam = "8-bit optimizer states (bitsandbytes)"
        out.append(_Candidate("8-bit AdamW", ("optimizer.name=adamw_8bit",), adam))
    if cfg.quantization.load_in != "4bit":
        # One process runs QLoRA on its own; several ranks share it with DeepSpeed ZeRO-2 (not ZeRO-3).
        one_gpu = world_size == 1
        engine = _engine_overrides("single" if one_gpu else "deepspeed", None if one_gpu else "zero2")
        name = "QLoRA: 4-bit base weights, " + ("one process" if one_gpu else "DeepSpeed ZeRO-2")
        cost = f"a quantized base; compute ~{KBIT_SLOWDOWN:.2f}x slower (dequantized on the fly)"
        out.append(_Candidate(name, ("lora.enabled=true", "quantization.load_in=4bit", *engine), cost))
    if not (cfg.distributed.strategy == "deepspeed" and (cfg.distributed.preset or "").endswith("offload")):
        offload = _engine_overrides("deepspeed", "zero3_offload")
        cost = "optimizer steps on the CPU (much slower steps), {host_ram_gib:.0f} GiB of host RAM"
        out.append(_Candidate("offload to CPU (DeepSpeed ZeRO-3 offload)", offload, cost))
    return out


def _engine_overrides(strategy: str, preset: str | None) -> tuple[str, ...]:
    """Overrides that switch the engine, dropping any user DeepSpeed file (the preset decides instead)."""
    return (
        f"distributed.strategy={strategy}",
        f"distributed.preset={preset or 'null'}",
        _NO_DS_CONFIG,
    )


def _configured_micro(cfg: ZerofitConfig) -> int | None:
    """The rows per micro-batch the config fixes (a token budget's too), None where it is `auto`."""
    micro = micro_batch_setting(cfg)
    return micro if isinstance(micro, int) else None


def _micro_change(cfg: ZerofitConfig, micro: int, per_rank: int) -> list[str]:
    """The overrides that run `micro` rows per micro-batch keeping the global batch: none where the config
    already runs it or leaves it to `auto`; a token budget's tokens where the config sets one; the
    accumulation too where no global batch derives it."""
    configured = _configured_micro(cfg)
    if configured is None or micro == configured:
        return []
    b = cfg.batch
    out = [
        f"batch.tokens_per_micro_batch={micro * cfg.data.max_seq_len}"
        if b.tokens_per_micro_batch is not None
        else f"batch.micro_batch_size={micro}"
    ]
    # The accumulation follows from a global batch; a config that fixes micro x accum instead changes both.
    fixed_accum = b.global_batch_size is None and b.grad_accum_steps is not None
    return out + ([f"batch.grad_accum_steps={per_rank // micro}"] if fixed_accum else [])


def _best_micro(
    scn: Scenario, per_rank: int, budget: Budget, prefer: int | None = None
) -> tuple[int, MemoryEstimate]:
    """`prefer` (the configured micro-batch) where it divides `per_rank` and fits: the remedy then changes
    nothing else; otherwise the largest fitting micro-batch for `scn`, or micro 1 (the smallest peak)."""
    if prefer is not None and per_rank % prefer == 0:
        est = estimate(scn.with_micro(prefer, per_rank // prefer))
        if verdict(est.total_gib, budget) == "fits":
            return prefer, est
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


def _remedy(
    cfg: ZerofitConfig, name: str, how: str, cost: str, scn: Scenario, per_rank: int, budget: Budget
) -> Remedy:
    """A remedy at the configured micro-batch where it fits there, else at the largest that fits
    (`_best_micro`), the micro-batch change then added to `how`."""
    m, est = _best_micro(scn, per_rank, budget, _configured_micro(cfg))
    how = " ".join([how, *_micro_change(cfg, m, per_rank)]).strip()
    cost = cost.format(host_ram_gib=est.host_ram_gib)
    return Remedy(name, how, m, est.total_gib, verdict(est.total_gib, budget), est.host_ram_gib, cost)


def _smaller_micro(cfg: ZerofitConfig, world_size: int, per_rank: int, budget: Budget) -> Remedy | None:
    """The configured run at the largest micro-batch that fits, where it is smaller than the configured
    one (the global batch kept, more micro-steps): the one-key fix, None where none fits or `auto` picks."""
    configured = _configured_micro(cfg)
    scn = _what_if(cfg, world_size, ()) if configured is not None else None
    if scn is None or configured is None:
        return None
    m, est = _best_micro(scn, per_rank, budget)
    if m >= configured or verdict(est.total_gib, budget) != "fits":
        return None
    cost = f"{per_rank // m} micro-steps per optimizer step instead of {per_rank // configured} (the same global batch)"
    how = " ".join(_micro_change(cfg, m, per_rank))
    name = "a smaller micro-batch (the largest that fits)"
    return Remedy(name, how, m, est.total_gib, "fits", est.host_ram_gib, cost)


def remedies(cfg: ZerofitConfig, world_size: int, budget: Budget) -> list[Remedy]:
    """What to change, the smallest change first: the micro-batch alone where a smaller one fits, then each
    remedy alone and those that compose together, the long-context levers, sequence parallelism on the
    ranks launched and the fewest GPUs that make the run fit while dividing the global batch, each at the
    configured micro-batch where it fits there (`_remedy`). Each is the run `resolve()` makes of the config
    with the remedy's overrides (`what_if`)."""
    per_rank = samples_per_rank(cfg, world_size) or 1
    out = _alone_and_combined(cfg, world_size, per_rank, budget)
    levers = _lever_remedy(cfg, world_size, per_rank, budget)
    out += [levers] if levers is not None else []
    global_batch = cfg.batch.global_batch_size or per_rank * world_size
    if world_size >= 2:  # the ranks launched can share each sequence: no more GPUs needed
        shared = _sequence_parallel_at(cfg, world_size, budget, global_batch, launched=True)
        out += [shared] if shared is not None else []
    more = _more_gpus(cfg, world_size, budget, global_batch)
    out += [more] if more is not None else []
    return _smallest_first(_smaller_micro(cfg, world_size, per_rank, budget), out)


def _smallest_first(smaller: Remedy | None, found: list[Remedy]) -> list[Remedy]:
    """The remedies that fit before those that do not, fewest changed keys first (a stable sort); after the
    micro-batch change where there is one, and then only those that fit a larger micro-batch than it (the
    others add a change and gain nothing the micro-batch alone does not)."""
    if smaller is not None:
        found = [r for r in found if r.verdict == "fits" and r.micro_batch_size > smaller.micro_batch_size]
    ordered = sorted(found, key=lambda r: (r.verdict != "fits", r.changes))
    return ([smaller] if smaller is not None else []) + ordered


def _alone_and_combined(cfg: ZerofitConfig, world_size: int, per_rank: int, budget: Budget) -> list[Remedy]:
    """Each remedy of `_remedy_candidates` alone, then those that compose applied together."""
    out: list[Remedy] = []
    combined: list[str] = []
    applied: list[str] = []
    engine_changed = False
    for cand in _remedy_candidates(cfg, world_size):
        scn = _what_if(cfg, world_size, cand.overrides)
        if scn is None:
            continue
        out.append(_remedy(cfg, cand.name, cand.how, cand.cost, scn, per_rank, budget))
        # Combine everything that composes; only one engine change (QLoRA's comes first) can apply.
        if not (cand.changes_engine and engine_changed):
            combined.extend(o for o in cand.overrides if o not in combined)
            applied.append(cand.name)
            engine_changed = engine_changed or cand.changes_engine
    if len(applied) > 1:
        scn = _what_if(cfg, world_size, combined)
        if scn is not None:
            name = "combined: " + " + ".join(applied)
            out.append(_remedy(cfg, name, _typed(combined), "the costs of each", scn, per_rank, budget))
    return out


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
    cost = "each lever's extra compute or host transfers"
    return _remedy(cfg, "long-context levers", how, cost, scn, per_rank, budget) if how else None


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
            m, est = _best_micro(scn, global_batch // n, budget, _configured_micro(cfg))
            if verdict(est.total_gib, budget) == "fits":
                change = " ".join([*_shown_engine(cfg, engine), *_micro_change(cfg, m, global_batch // n)])
                how = _launch(n, change)
                name = f"more GPUs: {n}" + (" with ZeRO-3" if engine else "")
                cost = f"{n} GPUs instead of {world_size}"
                return Remedy(name, how, m, est.total_gib, "fits", est.host_ram_gib, cost)
        shared = _sequence_parallel_at(cfg, n, budget, global_batch)
        if shared is not None:
            return shared
    return None


def _launch(n: int, change: str) -> str:
    """A launch on `n` ranks with `change` (the overrides; none where the config runs as it is)."""
    return f"launch {n} ranks (e.g. deepspeed --num_gpus {n})" + (f" with {change}" if change else "")


def _shown_engine(cfg: ZerofitConfig, engine: Iterable[str]) -> list[str]:
    """An engine change as the user types it: the keys that differ from the config's (DeepSpeed's strategy
    only where the config runs another, the implied `distributed.ds_config=null` never)."""
    shown = [o for o in engine if o not in (_NO_DS_CONFIG, "distributed.strategy=deepspeed")]
    if cfg.distributed.strategy != "deepspeed" and any(o.startswith("distributed.") for o in engine):
        shown.insert(0, "distributed.strategy=deepspeed")
    return shown


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
            micro = _micro_change(cfg, m, global_batch // (n // sp))
            change = " ".join(
                [*_shown_engine(cfg, engine), f"distributed.sequence_parallel={sp}", *levers, *micro]
            )
            how = change if launched else _launch(n, change)
            name = f"sequence parallelism: {sp} of the {n} GPUs share each sequence"
            cost = "all-to-alls in every layer" + ("" if launched else f"; {n} GPUs instead of 1")
            if not launched:
                name = f"more GPUs: {n} with sequence parallelism {sp}"
            return Remedy(name, how, m, est.total_gib, "fits", est.host_ram_gib, cost)
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
    m, est = _best_micro(scn, per_rank, budget, _configured_micro(cfg))
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
