"""The body of `launchers/launch_finetune.py`: parse -> resolve -> render -> build -> print plan -> train.

Order matters for the user: the config is resolved against the launcher's world size before anything heavy
is imported, so a batch that does not divide fails in a fraction of a second; the model and data are
loaded before the run directory is created, so a user error never writes into any run directory. Every
`ZerofitError` becomes one paragraph on stderr and exit code 2 on every rank, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from zerofit.config import ResolvedConfig, ZerofitConfig, load_config, resolve
from zerofit.errors import ConfigError, LaunchError, ZerofitError
from zerofit.strategies.env import LaunchEnv, launch_env

if TYPE_CHECKING:
    from zerofit.data import DataStats, Example, GlobalBatchSampler
    from zerofit.model import BuiltModel
    from zerofit.strategies.base import Strategy

EXIT_USER_ERROR = 2


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`--config FILE [dotted.key=value ...]`; the deepspeed launcher's `--local_rank` is accepted and ignored."""
    parser = argparse.ArgumentParser(
        prog="launch_finetune.py",
        description="Fine-tune with one exact global batch on DeepSpeed, FSDP2, DDP or one process.",
    )
    parser.add_argument("--config", required=True, help="run config YAML (see configs/)")
    # Ranks always come from the environment (RANK / LOCAL_RANK), whichever launcher started us.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. batch.global_batch_size=64")
    return parser.parse_intermixed_args(argv)  # overrides may come before and after --config


def _python_launch_hint(cfg: ZerofitConfig) -> str | None:
    """For a plain `python` start: the launch command a batch split that needs several ranks asks for."""
    b = cfg.batch
    if not (isinstance(b.micro_batch_size, int) and b.global_batch_size and b.grad_accum_steps):
        return None
    per_rank = b.micro_batch_size * b.grad_accum_steps
    if b.global_batch_size % per_rank or b.global_batch_size // per_rank < 2:
        return None
    n = b.global_batch_size // per_rank
    return (
        f"batch.global_batch_size = {b.global_batch_size} with batch.micro_batch_size = {b.micro_batch_size} "
        f"and batch.grad_accum_steps = {b.grad_accum_steps} needs {n} data-parallel ranks, but plain `python` "
        f"starts one process; launch {n} ranks with `deepspeed --num_gpus {n} launchers/launch_finetune.py "
        f"...` or `torchrun --nproc_per_node {n} launchers/launch_finetune.py ...`, or leave "
        "batch.grad_accum_steps unset so it is derived for one process"
    )


def resolve_for_launch(cfg: ZerofitConfig, env: LaunchEnv) -> ResolvedConfig:
    """`resolve()` with the launcher's world size; a multi-rank request under plain `python` says how to launch."""
    try:
        return resolve(cfg, env.world_size)
    except ConfigError:
        hint = None if env.launched else _python_launch_hint(cfg)
        if hint is None:
            raise
        raise LaunchError(hint) from None


def claim_run_dir(resolved: ResolvedConfig, strategy: Strategy) -> ResolvedConfig:
    """The run directory to write: the resolved one, or (when it already holds a run and this is not a
    resume) the first free `<run_name>-2`, `-3`, ... so an earlier run is never touched. Rank 0 decides."""
    cfg = resolved.config
    name = cfg.run_name or "run"
    if strategy.rank == 0 and not cfg.checkpoint.resume:
        suffix = 1
        while _holds_run(Path(cfg.output_dir) / name):
            suffix += 1
            name = f"{cfg.run_name}-{suffix}"
    name = strategy.broadcast_object(name)
    if name == cfg.run_name:
        return resolved
    new_cfg = cfg.model_copy(deep=True)
    new_cfg.run_name = name
    return dataclasses.replace(resolved, config=new_cfg, run_dir=Path(new_cfg.output_dir) / name)


def _holds_run(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def write_run_files(resolved: ResolvedConfig, engine_config: dict[str, Any]) -> Path:
    """`config.yaml` (fully resolved) and the engine config exactly as the engine receives it (rank 0)."""
    from zerofit.render import engine_config_filename

    run_dir = resolved.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump(resolved.config.model_dump(mode="json"), sort_keys=False)
    )
    engine_file = run_dir / engine_config_filename(resolved.config.distributed.strategy)
    engine_file.write_text(json.dumps(engine_config, indent=2) + "\n")
    return engine_file


def format_plan(
    resolved: ResolvedConfig,
    built: BuiltModel,
    stats: DataStats,
    sampler: GlobalBatchSampler,
    mean_label_tokens: float,
    engine_file: Path,
    engine_config: dict[str, Any],
) -> str:
    """The run's every derived number, printed once on rank 0 before the first step."""
    cfg, plan = resolved.config, resolved.plan
    d, o, s, t = cfg.distributed, cfg.optimizer, cfg.scheduler, cfg.train
    engine = d.strategy + (f" / {d.preset}" if d.preset else "")
    trainable_pct = 100.0 * built.trainable_params / max(built.total_params, 1)
    lr = f"{resolved.effective_lr:.3g}"
    if o.lr_scaling != "none":
        lr += f" (= {o.lr:.3g} x {o.lr_scaling} scaling, global {plan.global_batch_size} vs base {o.base_batch_size})"
    epochs = t.max_steps / sampler.steps_per_epoch
    lines = [
        "zerofit plan",
        f"  batch        {plan.describe()}",
        f"  tokens/step  <= {plan.global_batch_size} x max_seq_len {cfg.data.max_seq_len} = "
        f"{plan.global_batch_size * cfg.data.max_seq_len:,} (data: ~{mean_label_tokens * plan.global_batch_size:,.0f}"
        " valid label tokens per step)",
        f"  model        {cfg.model.name_or_path}: {built.total_params:,} params, {built.trainable_params:,} "
        f"trainable ({trainable_pct:.2f}%), {resolved.method}, weights in {str(built.load_dtype).removeprefix('torch.')}",
        f"  engine       {engine}, precision {t.precision}, clip {t.max_grad_norm or 'off'}",
        f"  engine file  {engine_file}",
        f"  data         {cfg.data.path}: {stats.n_examples:,} examples ({stats.n_truncated} truncated to "
        f"{cfg.data.max_seq_len} tokens, {stats.n_dropped} dropped), {sampler.steps_per_epoch} steps/epoch",
        f"  grad sync    {gradient_sync(resolved, engine_config)}",
        f"  optimizer    {optimizer_owner(o.name, engine_config)}, lr {lr}, {s.name} schedule, "
        f"warmup {s.warmup_steps}",
        f"  steps        {t.max_steps} optimizer steps (~{epochs:.2f} epochs)",
        f"  run dir      {resolved.run_dir}",
    ]
    if sampler.remainder and sampler.partial_window == "drop":
        lines.append(
            f"  note         partial window 'drop': the last {sampler.remainder} of {stats.n_examples} examples "
            "of every epoch's order are not trained on (set train.partial_window=normalize to use them)"
        )
    return "\n".join(lines)


def gradient_sync(resolved: ResolvedConfig, engine_config: dict[str, Any]) -> str:
    """When gradients are communicated inside a window, and what that costs (DESIGN: state the trade-off)."""
    if resolved.plan.dp_size == 1:
        return "none (one data-parallel rank)"
    if resolved.config.distributed.strategy == "deepspeed":
        stage = int(engine_config.get("zero_optimization", {}).get("stage", 0))
        if stage >= 2:
            return f"every micro-step (ZeRO-{stage} reduce-scatters into its gradient partitions by design)"
        return f"once per window, at the boundary (ZeRO-{stage})"
    sync = engine_config.get("gradient_accumulation", {}).get("sync", "boundary_only")
    return "every micro-step" if sync == "every_micro_step" else "once per window (no sync inside it)"


def optimizer_owner(name: str, engine_config: dict[str, Any]) -> str:
    """The optimizer that runs the step: zerofit's client optimizer or DeepSpeed's from the config."""
    block = engine_config.get("optimizer")
    if isinstance(block, dict):
        return f"DeepSpeed {block.get('type', 'optimizer')} (offload preset, runs the step on the CPU)"
    return name


def model_flops_per_token(built: BuiltModel, seq_len: int) -> float:
    """Model FLOPs to train one token of this model (for MFU; formula in zerofit.metrics.throughput)."""
    from zerofit.metrics.throughput import train_flops_per_token

    hf_config = built.model.config  # peft forwards `.config` to the wrapped HF model
    return train_flops_per_token(
        built.total_params,
        built.trainable_params,
        n_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        seq_len=seq_len,
    )


def quiet_libraries() -> None:
    """Silence library chatter that would bury the plan and the progress line (errors still show)."""
    # bitsandbytes warns at import that an optional CPU kernel package is missing; it is not needed.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # Deprecations inside transformers/DeepSpeed internals that users cannot act on.
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r".*(is_gradient_checkpointing|all_gather_into_tensor|reduce_scatter_tensor).*",
    )
    # FSDP's sharded grad scaler (fp16) keeps a 1-element found-inf tensor that DTensor warns about.
    warnings.filterwarnings("ignore", category=UserWarning, message=r"Found a non-scalar tensor with numel=1")


def loss_summary(losses: list[float]) -> str:
    """Start and end loss, each a mean over a few steps (one global batch's loss is noisy)."""
    k = max(1, min(10, len(losses) // 2))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return f"loss {first:.4f} -> {last:.4f} (mean of the first / last {k} steps)"


def _say(strategy: Strategy, message: str) -> None:
    if strategy.rank == 0:
        print(message, flush=True)


def load_model_and_data(
    resolved: ResolvedConfig, strategy: Strategy
) -> tuple[BuiltModel, list[Example], DataStats, GlobalBatchSampler]:
    """The model (seeded the same on every rank), the tokenized data and its global-batch sampler."""
    from transformers import set_seed

    from zerofit.data import GlobalBatchSampler, load_sft_dataset
    from zerofit.model import build_model, load_tokenizer

    cfg = resolved.config
    # Data first (it needs only the tokenizer): a bad line fails in seconds, not after a 7B load.
    tokenizer = load_tokenizer(cfg)
    examples, stats = load_sft_dataset(cfg.data.path, tokenizer, cfg.data.max_seq_len)
    set_seed(cfg.seed)  # the same LoRA init and dropout stream on every rank and every split
    # Quantized weights are quantized on the GPU they will live on, at load time (one GPU per rank).
    on_gpu = strategy.device.type == "cuda" and cfg.quantization.load_in != "none"
    built = build_model(cfg, device_map={"": strategy.device.index} if on_gpu else None, tokenizer=tokenizer)
    sampler = GlobalBatchSampler(
        len(examples), resolved.plan.global_batch_size, cfg.seed, cfg.data.shuffle, cfg.train.partial_window
    )
    return built, examples, stats, sampler


def announce(
    resolved: ResolvedConfig,
    strategy: Strategy,
    engine_config: dict[str, Any],
    built: BuiltModel,
    examples: list[Example],
    stats: DataStats,
    sampler: GlobalBatchSampler,
) -> None:
    """Rank 0 writes config.yaml + the engine config and prints the plan; every rank waits for it."""
    if strategy.rank == 0:
        engine_file = write_run_files(resolved, engine_config)
        mean_tokens = sum(sum(label != -100 for label in e.labels) for e in examples) / len(examples)
        plan = format_plan(resolved, built, stats, sampler, mean_tokens, engine_file, engine_config)
        print(plan, flush=True)
    strategy.barrier()


def train_run(resolved: ResolvedConfig, config_path: str) -> int:
    """Build everything for a resolved config and train it; returns the exit code."""
    quiet_libraries()
    import torch

    from zerofit.checkpoint import Checkpointer, export_final
    from zerofit.metrics.setup import open_sinks
    from zerofit.optim import build_optimizer, build_scheduler
    from zerofit.render import render_engine_config
    from zerofit.strategies import build_strategy
    from zerofit.train import TrainRun, train_loop

    engine_config = render_engine_config(resolved, "cuda" if torch.cuda.is_available() else "cpu")
    strategy = build_strategy(resolved, engine_config)
    try:
        built, examples, stats, sampler = load_model_and_data(resolved, strategy)
        resolved = claim_run_dir(resolved, strategy)  # only now, with model and data known good, write
        cfg = resolved.config
        announce(resolved, strategy, engine_config, built, examples, stats, sampler)
        model = strategy.prepare(
            built.model,
            lambda m: build_optimizer(m, cfg, resolved.effective_lr),
            lambda opt: build_scheduler(opt, cfg, cfg.train.max_steps),
        )
        checkpointer = Checkpointer(strategy, resolved.run_dir, cfg.checkpoint, cfg.train.max_steps)
        start_step = checkpointer.resume() if cfg.checkpoint.resume else 0
        if start_step:
            _say(strategy, f"resumed from checkpoint at step {start_step}")
        extra = {
            "engine_config": engine_config,
            "params_total": built.total_params,
            "params_trainable": built.trainable_params,
            "data_stats": dataclasses.asdict(stats),
        }
        sink = open_sinks(resolved, strategy.rank, extra, config_path=config_path)
        try:
            run = TrainRun(
                strategy=strategy,
                model=model,
                examples=examples,
                sampler=sampler,
                plan=resolved.plan,
                max_steps=cfg.train.max_steps,
                max_grad_norm=cfg.train.max_grad_norm,
                pad_id=int(built.tokenizer.pad_token_id),
                sink=sink,
                checkpointer=checkpointer,
                log_every=cfg.logging.log_every,
                flops_per_token=model_flops_per_token(built, cfg.data.max_seq_len),
                precision=cfg.train.precision,
            )
            results = train_loop(run, start_step)
            exported = (
                export_final(strategy, built.tokenizer, resolved.run_dir)
                if cfg.checkpoint.save_final
                else None
            )
        finally:
            sink.close()
        if results:
            _say(strategy, f"done: {len(results)} steps, {loss_summary([r.loss for r in results])}")
        _say(strategy, f"results: {resolved.run_dir}" + (f" (export: {exported})" if exported else ""))
        # Leave together: a rank that tears gloo down while a peer still has work in flight can abort
        # that peer after a successful run. (Only on success: after an error, ranks may not all get here.)
        strategy.barrier()
        return 0
    finally:
        strategy.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `launchers/launch_finetune.py`; returns the process exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = launch_env()
    try:
        resolved = resolve_for_launch(load_config(args.config, args.overrides), env)
        return train_run(resolved, args.config)
    except ZerofitError as exc:
        # One paragraph, every rank, no traceback: the message names the field, the rule and the fix.
        print(f"zerofit (rank {env.rank}): error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
