"""What a run prints about itself: the plan before the first step (every derived number, once, on rank 0)
and the lines at its end (loss, best evaluation).

Formatting only: `zerofit.recipe.run` decides when to print; the numbers come from the run plan
(`zerofit.engine_spec.run_plan.RunPlan`) and the assembled run (`zerofit.recipe.assembly.PreparedRun`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerofit.checkpoint.policy import followed_metric
from zerofit.config.schema import ZerofitConfig
from zerofit.core.run_layout import step_dir_name

if TYPE_CHECKING:
    from zerofit.checkpoint.policy import EvalWatch
    from zerofit.data import DataStats
    from zerofit.recipe.assembly import PreparedRun

__all__ = ["best_line", "describe_levers", "format_plan", "truncation_warning"]


def format_plan(run: PreparedRun, engine_file: Path) -> str:
    """The run's every derived number, printed once on rank 0 before the first step."""
    assert run.data is not None, "a training run is assembled with its data"
    run_plan, built, data = run.plan, run.built, run.data
    cfg, spec, plan, objective = run_plan.config, run_plan.spec, run_plan.batch, run_plan.objective
    line = objective.describe(cfg, run.reference.describe() if run.reference is not None else "")
    followed = followed_metric(objective)  # eval/loss, or an RL objective's eval/reward
    o, s, t = cfg.optimizer, cfg.scheduler, cfg.train
    stats, sampler = data.stats, data.sampler
    trainable_pct = 100.0 * built.trainable_params / max(built.total_params, 1)
    lr = f"{run_plan.effective_lr:.3g}"
    if o.lr_scaling != "none":
        lr += f" (= {o.lr:.3g} x {o.lr_scaling} scaling, global {plan.global_batch_size} vs base {o.base_batch_size})"
    ranks = plan.dp_size * spec.sequence_parallel  # every rank, sequence-parallel ones too
    lines = [
        "zerofit plan",
        f"  batch        {plan.describe()}{describe_sequence_parallel(spec.sequence_parallel)}",
        f"  tokens/step  {objective.tokens_per_step(cfg) or describe_tokens(plan.global_batch_size, cfg.data.max_seq_len, stats.format, data.mean_label_tokens)}",
        f"  model        {cfg.model.name_or_path}: {built.total_params:,} params, {built.trainable_params:,} "
        f"trainable ({trainable_pct:.2f}%), {run_plan.method}, weights in {str(built.load_dtype).removeprefix('torch.')}",
        *([f"  lora         {built.adapters}"] if built.adapters else []),
        f"  engine       {spec.describe_engine()}, precision {t.precision}, clip {t.max_grad_norm or 'off'}",
        f"  engine file  {engine_file}",
        f"  data         {describe_data(cfg.data.path, stats, cfg.data.max_seq_len)}, {sampler.steps_per_epoch} steps/epoch",
        *truncation_warning(cfg, stats),
        *(
            [f"  eval         {describe_eval(cfg, data.eval_stats, followed)}"]
            if data.eval_stats is not None
            else []
        ),
        f"  grad sync    {spec.describe_grad_sync()}",
        f"  compute      {describe_compute(cfg, built.model)}",
        *([f"  objective    {line}"] if line is not None else []),
        f"  optimizer    {spec.describe_optimizer(o.name)}, lr {lr}, {spec.describe_schedule(s.name, s.warmup_steps)}",
        f"  steps        {describe_steps(cfg, sampler.steps_per_epoch, followed)}",
        f"  checkpoints  {describe_checkpoints(cfg, data.eval_stats is not None, followed)}",
        f"  timeout      {describe_timeout(cfg, ranks)}",
        f"  run dir      {run_plan.run_dir}",
    ]
    if ranks > 1:
        lines.append(
            f"  storage      output_dir {cfg.output_dir!r} is shared by all {ranks} ranks (checked): each "
            "writes its part of every checkpoint there, so on several nodes it must be a shared filesystem"
        )
    lines += [f"  note         {note}" for note in run_plan.notes]
    if sampler.remainder and sampler.partial_window == "drop":
        lines.append(
            f"  note         partial window 'drop': the last {sampler.remainder} of {stats.n_examples} examples "
            "of every epoch's order are not trained on (set train.partial_window=normalize to use them)"
        )
    return "\n".join(lines)


def truncation_warning(cfg: ZerofitConfig, stats: DataStats) -> list[str]:
    """The plan's one warning line when more of the training data is cut than `data.truncation: warn`
    lets pass unsaid (`zerofit.data.truncation`), else nothing."""
    from zerofit.data.truncation import truncation_note

    note = truncation_note(stats, cfg.data.max_seq_len) if cfg.data.truncation == "warn" else None
    if note is None:
        return []
    return [f"  WARNING      {note} (data.truncation=error refuses such data; =allow says only the count)"]


def describe_tokens(global_batch: int, max_seq_len: int, fmt: str, mean_label_tokens: float) -> str:
    """`<= 16 x max_seq_len 512 = 8,192 (data: ~900 valid label tokens per step)`; a global batch of pairs
    is twice as many sequences (`<= 16 pairs x 2 sequences x max_seq_len 512 = 16,384 ...`)."""
    sequences = f"{global_batch} pairs x 2 sequences" if fmt == "preference" else f"{global_batch}"
    n = global_batch * max_seq_len * (2 if fmt == "preference" else 1)
    return (
        f"<= {sequences} x max_seq_len {max_seq_len} = {n:,} (data: ~{mean_label_tokens * global_batch:,.0f} "
        "valid label tokens per step)"
    )


def describe_steps(cfg: ZerofitConfig, steps_per_epoch: int, followed: str) -> str:
    """`60 optimizer steps (train.epochs 3 x 20 steps/epoch)`, or `20 optimizer steps (~0.33 epochs)`;
    early stopping on `followed` (eval/loss, or an RL objective's eval/reward)."""
    t = cfg.train
    assert t.max_steps is not None
    if t.epochs is not None:
        how = f"train.epochs {t.epochs} x {steps_per_epoch} steps/epoch"
    else:
        how = f"~{t.max_steps / steps_per_epoch:.2f} epochs"
    text = f"{t.max_steps} optimizer steps ({how})"
    es = t.early_stopping
    if es.patience > 0:
        text += (
            f"; early stopping after {es.patience} evaluation(s) without an {followed} improvement of more "
            f"than {es.min_delta:g}"
        )
    return text


def describe_checkpoints(cfg: ZerofitConfig, has_eval: bool, followed: str) -> str:
    """The save and keep policy: `every 30 min and at the end, keep last 2 + best eval/loss` (`followed`)."""
    c = cfg.checkpoint
    when = [f"every {c.every_steps} steps"] if c.every_steps else []
    if c.every_minutes:
        when.append(f"every {c.every_minutes:g} min")
    when.append("at the end")
    keep = f"keep last {c.keep_last}"
    if c.keep_best and has_eval:
        keep += f" + best {followed} (saved at each new best)"
    return f"{' and '.join(when)} (and when stopped), {keep}"


def describe_sequence_parallel(sp: int) -> str:
    """The batch line's tail under Ulysses sequence parallelism (empty without it)."""
    if sp == 1:
        return ""
    return f"; sequence parallel {sp}: each sequence sharded over {sp} ranks (Ulysses all-to-all attention)"


def describe_timeout(cfg: ZerofitConfig, dp_size: int) -> str:
    """The process-group timeout, and that zerofit's own rank-0-only work does not count against it."""
    minutes = f"{cfg.distributed.timeout_minutes:g} min"
    if dp_size == 1:
        return f"{minutes} (distributed.timeout_minutes; one rank: no collective waits on a peer)"
    return (
        f"collectives wait {minutes} for a peer (distributed.timeout_minutes); rank 0's tokenizing, checkpoint "
        "verification and export are waited for without a limit"
    )


def describe_compute(cfg: ZerofitConfig, model: Any) -> str:
    """Checkpointing (as resolved: `auto` is a number by now), the loss, and the token budget if any."""
    from zerofit.levers.attention import describe_attention, module_kernel
    from zerofit.levers.recompute import checkpointed_layers, describe_checkpointing

    # peft forwards `.config`; a vision-language model's layer count and vocabulary are its language model's
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = int(config.num_hidden_layers)
    n = checkpointed_layers(cfg.train.activation_checkpointing, layers)
    loss = cfg.train.cross_entropy
    if loss == "fused_linear":
        from zerofit.token_loss.fused import describe_fused

        device = next(model.parameters()).device.type
        loss += f" ({describe_fused(int(config.vocab_size), device)})"
    text = f"activation checkpointing: {describe_checkpointing(n, layers)}, {loss} cross-entropy"
    masked = cfg.batch.tokens_per_micro_batch is not None or cfg.batch.micro_batch_size > 1
    text += ", attention: " + describe_attention(cfg.model.attn_implementation, module_kernel(model), masked)
    if cfg.train.kernels != "none":
        text += f", kernels {cfg.train.kernels} (RMSNorm, SwiGLU, RoPE)"
    if cfg.train.compile:
        from zerofit.levers.compiling import describe_compile

        text += f", {describe_compile(layers, n)}"
    levers = describe_levers(cfg.train.tiled_mlp, cfg.train.activation_offload, cfg.train.lean_norm, n)
    if levers:
        text += f", {levers}"
    tokens = cfg.batch.tokens_per_micro_batch
    if tokens is not None:
        rows = cfg.batch.micro_batch_size
        text += (
            f", token budget {tokens} per micro-batch ({rows} packed rows of {cfg.data.max_seq_len}; "
            "micro = rows, accum = at most)"
        )
    return text


def describe_levers(
    tiled_mlp: Any, activation_offload: Any, lean_norm: Any, checkpointed: int | None = None
) -> str:
    """The memory levers that are on, each with its setting (set explicitly or chosen by `auto`, resolved by
    now): `tiled MLP 16 shards, activation offload on (...), lean norm on`; empty when none is. Printed in
    the launch's plan (`compute`) and by `zerofit plan`, so the plan says every lever that changes the step."""
    from zerofit.levers.offload import describe_offload
    from zerofit.levers.tiling import tiled_mlp_shards

    parts = []
    shards = tiled_mlp_shards(tiled_mlp)
    if shards > 0:
        parts.append(f"tiled MLP {shards} shards (train.tiled_mlp)")
    if activation_offload is True:
        where = (
            describe_offload(checkpointed, True)
            if checkpointed
            else "the checkpointed layers' inputs -> pinned host memory"
        )
        parts.append(f"activation offload on ({where})")
    if lean_norm is True:
        parts.append("lean norm on (RMSNorms save their input in its own dtype)")
    return ", ".join(parts)


def describe_data(path: str, stats: DataStats, max_seq_len: int) -> str:
    """`data/x.jsonl [messages, detected]: 3,000 examples (2 truncated to 512 tokens, 3 dropped: 3 for an
    empty response)`; preference pairs: `600 pairs (4 truncated to 512 tokens per sequence, 3 with the
    prompt cut from its start, 5 dropped: 2 with identical chosen and rejected, 3 for an empty response)`."""
    how = [stats.format + (", detected" if stats.detected else "")]
    if stats.from_cache:
        how.append("from the tokenization cache")
    pairs = stats.format == "preference"
    notes = f"{stats.n_truncated} truncated to {max_seq_len} tokens{' per sequence' if pairs else ''}"
    if pairs:
        notes += f", {stats.n_prompt_cut} with the prompt cut from its start"
    notes += f", {stats.n_dropped} dropped"
    why = [f"{stats.n_identical} with identical chosen and rejected"] if stats.n_identical else []
    if stats.n_empty and stats.empty_responses == "drop":
        why.append(f"{stats.n_empty} for an empty response")
    if why:
        notes += ": " + ", ".join(why)
    if stats.n_empty and stats.empty_responses != "drop":
        notes += (
            f", {stats.n_empty} with an empty response kept (data.empty_responses=keep: they learn eos only)"
        )
    if stats.n_split:
        notes += f", {stats.n_split} long texts split"
    return f"{path} [{'; '.join(how)}]: {stats.n_examples:,} {'pairs' if pairs else 'examples'} ({notes})"


def describe_eval(cfg: ZerofitConfig, stats: DataStats, followed: str) -> str:
    """Where the evaluation data comes from and when `followed` (the loss, an RL run's reward) is computed."""
    d = cfg.data
    if d.eval_path is not None:
        source = d.eval_path
    elif isinstance(d.eval_split, str):
        source = f"split {d.eval_split!r} of {d.path}"
    else:
        source = f"{d.eval_split:g} of {d.path}'s records held out"
    when = f"every {cfg.eval.every_steps} steps and at the end" if cfg.eval.every_steps else "at the end"
    unit = {"preference": "pairs", "prompt": "prompts", "conversational prompt": "prompts"}.get(stats.format)
    what = f"{followed} ({cfg.eval.sampling} answers)" if "prompt" in stats.format else "loss"
    return f"{stats.n_examples:,} {unit or 'examples'} ({source}), {what} {when}"


def best_line(watch: EvalWatch, checkpoints: Path, keep_best: bool) -> str:
    """`best: eval/loss 1.2345 at step 40 (checkpoint ..., export it with zerofit export RUN --step best)`."""
    text = f"best: {watch.metric} {watch.best_value:.4f} at step {watch.best_step}"
    folder = checkpoints / step_dir_name(watch.best_step)
    if keep_best and folder.is_dir():
        text += f" (checkpoint {folder}; zerofit export {checkpoints.parent} --step best --out DIR)"
    return text
