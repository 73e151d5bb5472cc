"""The `auto` choice: the fastest (micro-batch, checkpointed layers, levers) that fits the GPU and keeps
the global batch, for `batch.micro_batch_size`, `batch.tokens_per_micro_batch`,
`train.activation_checkpointing` and the `auto` levers (`choose_plan`, what `resolve()` is handed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit.config.rules.batch import PlanChoice, micro_batch_setting
from zerofit.core.errors import ConfigError
from zerofit.engine_spec.user_ds_config import pinned_split_problems
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario, what_if
from zerofit.planner.search.budget import Budget, resolve_budget
from zerofit.planner.search.options import PlanOption, fastest_options, lever_variants
from zerofit.planner.search.remedies import remedies
from zerofit.planner.search.table import samples_per_rank
from zerofit.planner.shapes import model_shape

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


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
