"""Config rules of the batch: the micro-batch setting (a token budget's rows), the `auto` keys the planner's chooser
decides (`PlanChoice`, `PlanChooser`), the exact split of the global batch, and filling it in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zerofit.config.batching import BatchConfigError, BatchSplit, solve_batch
from zerofit.config.rules.engine import data_parallel_size
from zerofit.config.schema import DEFAULT_MAX_STEPS, ZerofitConfig
from zerofit.core.errors import ConfigError


@dataclass(frozen=True)
class PlanChoice:
    """What the planner decides for the `auto` keys: the micro-batch (rows of packed tokens under a token
    budget), the decoder layers to checkpoint (`true`, `false` or a number), the MLP's token shards
    (`false` or a number), whether the checkpointed inputs are offloaded to host memory and whether the
    RMSNorms are lean (`train.lean_norm`), and the loss (`train.cross_entropy`: `chunked` or
    `fused_linear`). A value is written into the config only where its key is `auto`."""

    micro_batch_size: int
    activation_checkpointing: bool | int
    tiled_mlp: bool | int = False
    activation_offload: bool = False
    lean_norm: bool = False
    cross_entropy: str = "chunked"
    loss_reason: str = ""  # why `train.cross_entropy: auto` became `cross_entropy` (the plan's note)


# `auto` batch / checkpointing keys: (config, world size) -> the plan to use; raises ConfigError.
PlanChooser = Callable[[ZerofitConfig, int], PlanChoice]
# A batch split error in the objective's own terms, or None (`ObjectiveSpec.batch_problem`).
Explain = Callable[[str], str | None]


def micro_batch_setting(cfg: ZerofitConfig, problems: list[str] | None = None) -> int | str | None:
    """`batch.micro_batch_size`, or under a token budget the rows per micro-batch it gives (`auto` stays
    `auto`). Problems with the token budget are appended to `problems` (and give None)."""
    b, seq = cfg.batch, cfg.data.max_seq_len
    tokens = b.tokens_per_micro_batch
    if tokens is None:
        return b.micro_batch_size
    found = problems if problems is not None else []
    if b.micro_batch_size is not None:
        found.append(
            f"batch.tokens_per_micro_batch = {tokens!r} and batch.micro_batch_size = {b.micro_batch_size!r}: a "
            "token budget decides the micro-batch (tokens / data.max_seq_len packed rows), so set one of them"
        )
        return None
    if tokens == "auto":
        return "auto"
    if tokens <= 0 or seq <= 0 or tokens % seq:
        lower, upper = max(seq, tokens // max(seq, 1) * seq), (tokens // max(seq, 1) + 1) * seq
        found.append(
            f"batch.tokens_per_micro_batch = {tokens}: examples are packed into rows of data.max_seq_len = {seq} "
            f"tokens, so the budget must be a positive multiple of {seq} (e.g. {lower} or {upper})"
        )
        return None
    return tokens // seq


def _auto_keys(cfg: ZerofitConfig) -> list[str]:
    """The batch / checkpointing keys set to `auto` (the plan chooser decides them)."""
    b = cfg.batch
    return [
        key
        for key, value in (
            ("batch.micro_batch_size", b.micro_batch_size),
            ("batch.tokens_per_micro_batch", b.tokens_per_micro_batch),
            ("train.activation_checkpointing", cfg.train.activation_checkpointing),
            ("train.tiled_mlp", cfg.train.tiled_mlp),
            ("train.activation_offload", cfg.train.activation_offload),
            ("train.lean_norm", cfg.train.lean_norm),
            ("train.cross_entropy", cfg.train.cross_entropy),
        )
        if value == "auto"
    ]


def check_batch(
    cfg: ZerofitConfig, world_size: int, chooser: PlanChooser | None, problems: list[str], explain: Explain
) -> BatchSplit | None:
    """The exact split of a given micro-batch (None while it is `auto`: `choose` solves it), or problems
    appended. Nothing is chosen here: the chooser runs last, on a config every other check passed."""
    b = cfg.batch
    micro = micro_batch_setting(cfg, problems)
    if micro is None and b.tokens_per_micro_batch is not None:
        return None  # the token budget's problem is already reported
    autos = _auto_keys(cfg)
    if autos and chooser is None:
        problems.append(
            f"{' and '.join(autos)} = 'auto' needs the memory planner to choose it, and this entry point has "
            "none; set a value instead of auto"
        )
        return None
    if micro == "auto":
        return None
    try:
        dp = data_parallel_size(cfg, world_size)
        return solve_batch(dp, b.global_batch_size, micro, b.grad_accum_steps)  # type: ignore[arg-type]
    except BatchConfigError as exc:
        problems.append(batch_problem(cfg, exc, explain))
        return None


def choose(
    cfg: ZerofitConfig,
    world_size: int,
    chooser: PlanChooser | None,
    plan: BatchSplit | None,
    explain: Explain,
) -> tuple[BatchSplit, PlanChoice | None]:
    """The planner's choice for the `auto` keys and the split it gives; raises its problems.

    Called once every check found nothing wrong: the chooser weighs candidate runs that `resolve()` itself
    derives, and a problem elsewhere in the config must be reported as itself, not as "nothing fits".
    """
    if not _auto_keys(cfg):
        assert plan is not None  # solved by `check_batch`
        return plan, None
    assert chooser is not None  # `check_batch` reported auto without a chooser
    choice = chooser(cfg, world_size)  # raises ConfigError (with the remedies) when nothing fits
    if plan is not None:
        return plan, choice
    try:
        dp = data_parallel_size(cfg, world_size)
        return solve_batch(dp, cfg.batch.global_batch_size, choice.micro_batch_size, None), choice
    except BatchConfigError as exc:
        raise ConfigError([batch_problem(cfg, exc, explain)]) from None


def batch_problem(cfg: ZerofitConfig, exc: BatchConfigError, explain: Explain) -> str:
    """A batch split error, in the objective's terms where it has its own (`explain`), else in the token
    budget's terms when that is what the user set."""
    tokens, seq = cfg.batch.tokens_per_micro_batch, cfg.data.max_seq_len
    worded = explain(str(exc))
    if worded is not None:  # the objective's own terms (a global batch of completions, say)
        return worded
    if tokens is None:
        return f"batch: {exc}"
    return (
        f"batch: batch.tokens_per_micro_batch = {tokens} packs {seq}-token rows, {tokens // seq if isinstance(tokens, int) else 'auto'} "
        f"per micro-batch, and the micro-batch counts rows here (multiply a valid micro_batch_size by {seq} "
        f"for a valid token budget): {exc}"
    )


def fill_batch(cfg: ZerofitConfig, plan: BatchSplit, choice: PlanChoice | None) -> None:
    """Write the decided split, the planner's checkpointing choice and the run length into `cfg`."""
    t = cfg.train
    if choice is not None:
        if t.activation_checkpointing == "auto":
            t.activation_checkpointing = choice.activation_checkpointing
        if t.tiled_mlp == "auto":
            t.tiled_mlp = choice.tiled_mlp
        if t.activation_offload == "auto":
            t.activation_offload = choice.activation_offload
        if t.lean_norm == "auto":
            t.lean_norm = choice.lean_norm
        if t.cross_entropy == "auto":
            t.cross_entropy = choice.cross_entropy  # type: ignore[assignment]
    if cfg.batch.tokens_per_micro_batch is not None:
        cfg.batch.tokens_per_micro_batch = plan.micro_batch_size * cfg.data.max_seq_len
    if t.max_steps is None and t.epochs is None:
        t.max_steps = DEFAULT_MAX_STEPS
    # With train.epochs, train.max_steps stays None here: epochs x steps per epoch is known only once the
    # data is loaded (`zerofit.recipe.assembly`, which fills it in; config.yaml records both).
    cfg.batch.global_batch_size = plan.global_batch_size
    cfg.batch.micro_batch_size = plan.micro_batch_size
    cfg.batch.grad_accum_steps = plan.grad_accum_steps
