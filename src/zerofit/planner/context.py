"""`zerofit plan --max-context`: the longest context (`data.max_seq_len`) at micro-batch 1 that fits a budget.

Every combination of the long-context levers the config may use is a candidate (each the run `resolve()`
makes of the config with those overrides, `what_if`): every decoder layer checkpointed; activation offload
off / on; the tiled MLP off or in 2..64 token shards (`scenario.TILED_MLP_SHARDS`, the shard counts
`train.tiled_mlp: auto` weighs too, so what this reports an `auto` config reaches); the config's loss or
`fused_linear` (unless LoRA adapts lm_head, which the fused loss refuses); under k-bit quantization
`quantization.fp32_residual` true or false; the lean RMSNorm (`train.lean_norm`) off / on. For each, the
longest fitting length is found by bisection over multiples of `STEP` tokens up to
`SEARCH_MAX` (the peak grows with the length, so the fitting lengths are a prefix). The answer is the
longest of them, capped at the model's `max_position_embeddings` (beyond it the model was not trained:
`limited_by` says which bound stopped it, and `memory_tokens` is what memory alone allows); among the
candidates that reach it, the fastest by the speed model (`speed.py`), so a lever is named only where it
is needed at that length or is free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING, Any, Protocol

from zerofit.catalogue.models import model_config_dict
from zerofit.core.errors import ConfigError
from zerofit.levers.norms import LEAN_NORM_MODEL_TYPES
from zerofit.planner.estimate import MemoryEstimate, estimate
from zerofit.planner.scenario import TILED_MLP_SHARDS, Scenario, what_if
from zerofit.planner.speed import predict_speed
from zerofit.token_loss.fused import logit_postprocessing

if TYPE_CHECKING:
    from zerofit.catalogue.gpus import GPU
    from zerofit.config.schema import ZerofitConfig


class Budget(Protocol):
    """What the search needs of a memory budget (`search.Budget` is one; named here, not imported, because
    the search's remedies use this module)."""

    @property
    def gib(self) -> float: ...

    @property
    def limit_gib(self) -> float: ...

    @property
    def gpu(self) -> GPU | None: ...


STEP = 1024  # lengths searched: multiples of this many tokens
SEARCH_MAX = 1 << 20  # the longest length the memory search tries
ASSUMPTIONS = (
    "micro-batch 1, one unpacked sequence: no padding mask",
    "attention through sdpa's memory-efficient / flash kernels: no sequence x sequence matrix is stored",
    "every decoder layer checkpointed; the global batch is kept by gradient accumulation",
)
# A preference objective: micro-batch 1 is one pair, two sequences padded to the longer.
PAIR_ASSUMPTIONS = (
    "micro-batch 1 pair: its chosen and rejected sequence, padded to the longer (a padding mask)",
    *ASSUMPTIONS[1:],
)


@dataclass
class MaxContext:
    """The longest context that fits, the override strings of the levers it needs, and its plan."""

    tokens: int | None  # None: not even STEP tokens fit
    levers: list[str]
    budget_gib: float
    limit_gib: float
    memory_tokens: int = 0  # the longest that fits memory, the model's position limit aside
    max_positions: int = 0  # the model's max_position_embeddings
    total_gib: float | None = None
    host_ram_gib: float | None = None
    tokens_per_s: float | None = None
    peak_phase: str | None = None
    next_total_gib: float | None = None  # the same levers at tokens + STEP (what stops the search)
    largest_terms: dict[str, float] = field(default_factory=dict)  # at tokens, GiB
    assumptions: tuple[str, ...] = ASSUMPTIONS

    def as_dict(self) -> dict[str, Any]:
        """The `max_context` block of `zerofit plan --max-context --json`."""
        return {
            "tokens": self.tokens,
            "levers": self.levers,
            "limited_by": "memory" if self.memory_tokens < self.max_positions else "max_position_embeddings",
            "memory_tokens": self.memory_tokens,
            "max_position_embeddings": self.max_positions,
            "budget_gib": round(self.budget_gib, 2),
            "limit_gib": round(self.limit_gib, 2),
            "total_gib": None if self.total_gib is None else round(self.total_gib, 3),
            "host_ram_gib": None if self.host_ram_gib is None else round(self.host_ram_gib, 2),
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
            "peak_phase": self.peak_phase,
            "next_step_total_gib": None if self.next_total_gib is None else round(self.next_total_gib, 3),
            "largest_terms": {k: round(v, 3) for k, v in self.largest_terms.items()},
            "step_tokens": STEP,
            "assumptions": list(self.assumptions),
        }


def _head_adapted(cfg: ZerofitConfig) -> bool:
    """LoRA adapts lm_head (the fused loss refuses it)."""
    targets = cfg.lora.target_modules
    if not cfg.lora.enabled or isinstance(targets, str):
        return False
    return any(t == "lm_head" or t.endswith(".lm_head") for t in targets)


def fused_loss_refusal(cfg: ZerofitConfig) -> str | None:
    """Why `train.cross_entropy: auto` may not choose the fused loss for this config (None: it may): the
    cases where `fused_linear` is refused or would fail at the first forward (`zerofit.token_loss.fused`)."""
    if _head_adapted(cfg):
        return "LoRA adapts lm_head (lora.target_modules), and the fused loss needs a plain Linear head"
    if cfg.model.trust_remote_code:
        return "model.trust_remote_code: a custom forward may change the logits after lm_head"
    config = model_config_dict(cfg.model.name_or_path)
    changed = logit_postprocessing({**config.get("text_config", {}), **config})
    return f"the model changes the logits after lm_head ({changed})" if changed else None


def lean_norm_applies(model: str) -> bool:
    """The model's RMSNorms are ones the lean norm knows (by config.json's model type, `zerofit.levers.norms`)."""
    return model_config_dict(model).get("model_type") in LEAN_NORM_MODEL_TYPES


def lever_combinations(cfg: ZerofitConfig) -> list[tuple[str, ...]]:
    """The override strings of every lever combination `--max-context` weighs, fewest levers first."""
    base = "chunked" if cfg.train.cross_entropy == "auto" else cfg.train.cross_entropy
    losses = [f"train.cross_entropy={base}"]
    if base != "fused_linear" and not _head_adapted(cfg):
        losses.append("train.cross_entropy=fused_linear")
    residual = ["quantization.fp32_residual=true"]
    if cfg.quantization.load_in != "none":
        residual.append("quantization.fp32_residual=false")
    out = []
    lean_norm = (False, True) if lean_norm_applies(cfg.model.name_or_path) else (cfg.train.lean_norm is True,)
    if (
        cfg.train.kernels != "none"
    ):  # Liger's RMSNorm saves what the lean norm saves; the two are not combined
        lean_norm = (False,)
    for lean, offload, shards, loss, resid in product(
        lean_norm, (False, True), TILED_MLP_SHARDS, losses, residual
    ):
        out.append(
            (
                "train.activation_checkpointing=true",
                f"train.activation_offload={str(offload).lower()}",
                f"train.tiled_mlp={shards if shards > 1 else 'false'}",
                loss,
                resid,
                f"train.lean_norm={str(lean).lower()}",
            )
        )
    return out


def _fits(scn: Scenario, seq: int, budget: Budget) -> MemoryEstimate | None:
    """The estimate at `seq` tokens when it fits the budget (else None)."""
    est = estimate(scn.with_levers(seq_len=seq))
    return est if est.total_gib <= budget.limit_gib else None


def longest_fitting(scn: Scenario, budget: Budget, max_len: int = SEARCH_MAX) -> int:
    """The longest multiple of STEP up to `max_len` that fits (0 when STEP does not): bisection."""
    lo, hi = 0, max_len // STEP  # lo fits (0 trivially), everything above hi is out of range
    if _fits(scn, STEP, budget) is None:
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(scn, mid * STEP, budget) is not None:
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP


def _candidates(cfg: ZerofitConfig, world_size: int) -> list[tuple[tuple[str, ...], Scenario]]:
    """Each lever combination's scenario at micro-batch 1 (those `resolve()` refuses left out)."""
    out = []
    for overrides in lever_combinations(cfg):
        try:
            out.append((overrides, what_if(cfg, world_size, overrides, micro_batch_size=1)))
        except ConfigError:
            continue
    return out


def needed_overrides(overrides: tuple[str, ...], cfg: ZerofitConfig) -> list[str]:
    """The overrides that change something from the config (what the user has to add)."""
    t, q = cfg.train, cfg.quantization
    current = {
        "train.activation_checkpointing": str(t.activation_checkpointing).lower(),
        "train.activation_offload": str(t.activation_offload).lower(),
        "train.tiled_mlp": str(t.tiled_mlp).lower(),
        "train.cross_entropy": t.cross_entropy,
        "quantization.fp32_residual": str(q.fp32_residual).lower(),
        "train.lean_norm": str(t.lean_norm).lower(),
    }
    return [o for o in overrides if current[o.partition("=")[0]] != o.partition("=")[2]]


def max_context(cfg: ZerofitConfig, world_size: int, budget: Budget) -> MaxContext:
    """The longest `data.max_seq_len` at micro-batch 1 that fits `budget`, over the lever combinations,
    and the fastest combination that reaches it (module docstring)."""
    positions = int(model_config_dict(cfg.model.name_or_path).get("max_position_embeddings") or SEARCH_MAX)
    found = [(longest_fitting(scn, budget), o, scn) for o, scn in _candidates(cfg, world_size)]
    memory_len = max((n for n, _, _ in found), default=0)
    best_len = min(memory_len, positions // STEP * STEP)
    result = MaxContext(None, [], budget.gib, budget.limit_gib, memory_len, positions)
    if found and found[0][2].pairs:
        result.assumptions = PAIR_ASSUMPTIONS
    if found and found[0][2].sequence_parallel > 1:
        sp = found[0][2].sequence_parallel
        result.assumptions = (
            *result.assumptions,
            f"sequence parallelism {sp}: each of {sp} ranks holds 1/{sp} of the sequence (Ulysses all-to-all "
            "attention, its communication from the GPU's stated interconnect bandwidth, not measured)",
        )
    if best_len == 0:
        return result
    gpu = budget.gpu
    reach = [(o, s.with_levers(seq_len=best_len)) for n, o, s in found if n >= best_len]
    # Stable: among equally fast candidates the one with fewer levers (listed first) wins.
    overrides, scn = max(reach, key=lambda c: predict_speed(c[1], gpu).tokens_per_s)
    est = estimate(scn)
    nxt = estimate(scn.with_levers(seq_len=best_len + STEP))
    top = sorted(est.breakdown.items(), key=lambda kv: -kv[1])[:4]
    result.tokens = best_len
    result.levers = [
        *needed_overrides(overrides, cfg),
        "batch.micro_batch_size=1",
        f"data.max_seq_len={best_len}",
    ]
    result.total_gib, result.host_ram_gib = est.total_gib, est.host_ram_gib
    result.tokens_per_s = predict_speed(scn, gpu).tokens_per_s
    result.peak_phase, result.next_total_gib = est.peak_phase, nxt.total_gib
    result.largest_terms = dict(top)
    return result
