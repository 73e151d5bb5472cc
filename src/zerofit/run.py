"""The body of `launchers/launch_finetune.py`: parse -> resolve -> assemble -> resume -> print plan -> train.

Order matters for the user: the config is resolved against the launcher's world size before anything heavy
is imported, so a batch that does not divide fails in a fraction of a second; the run is assembled
(`zerofit.assembly`: spec, engine, data, model) and any checkpoint restored before the run directory is
written, so a user error never writes into any run directory. Every `ZerofitError` becomes one paragraph
on stderr and exit code 2 on every rank, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from zerofit.config import ResolvedConfig, ZerofitConfig, load_config, resolve
from zerofit.errors import ConfigError, LaunchError, ZerofitError
from zerofit.messages import error, line_buffered_output, quiet_libraries, say
from zerofit.planner import choose_fastest_plan
from zerofit.run_layout import RunLayout
from zerofit.signals import StopSignal, die_with_launcher, die_with_parent
from zerofit.strategies.env import LaunchEnv, launch_env

if TYPE_CHECKING:
    from zerofit.assembly import PreparedRun
    from zerofit.checkpoint.policy import EvalWatch
    from zerofit.data import DataStats

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
        return resolve(cfg, env.world_size, choose_fastest_plan)
    except ConfigError:
        hint = None if env.launched else _python_launch_hint(cfg)
        if hint is None:
            raise
        raise LaunchError(hint) from None


def write_run_files(run: PreparedRun) -> Path:
    """`config.yaml` (fully resolved) and the engine config exactly as the engine receives it (rank 0)."""
    run_dir = run.resolved.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = RunLayout(run_dir)
    layout.config.write_text(yaml.safe_dump(run.resolved.config.model_dump(mode="json"), sort_keys=False))
    engine_file = layout.engine_file(run.spec.strategy)
    engine_file.write_text(json.dumps(run.spec.to_json(), indent=2) + "\n")
    return engine_file


def format_plan(run: PreparedRun, engine_file: Path) -> str:
    """The run's every derived number, printed once on rank 0 before the first step."""
    assert run.data is not None, "a training run is assembled with its data"
    resolved, spec, built, data = run.resolved, run.spec, run.built, run.data
    cfg, plan = resolved.config, spec.plan
    o, s, t = cfg.optimizer, cfg.scheduler, cfg.train
    stats, sampler = data.stats, data.sampler
    trainable_pct = 100.0 * built.trainable_params / max(built.total_params, 1)
    lr = f"{resolved.effective_lr:.3g}"
    if o.lr_scaling != "none":
        lr += f" (= {o.lr:.3g} x {o.lr_scaling} scaling, global {plan.global_batch_size} vs base {o.base_batch_size})"
    assert t.max_steps is not None, "the data settles train.max_steps of a train.epochs run"
    lines = [
        "zerofit plan",
        f"  batch        {plan.describe()}",
        f"  tokens/step  <= {plan.global_batch_size} x max_seq_len {cfg.data.max_seq_len} = "
        f"{plan.global_batch_size * cfg.data.max_seq_len:,} (data: ~{data.mean_label_tokens * plan.global_batch_size:,.0f}"
        " valid label tokens per step)",
        f"  model        {cfg.model.name_or_path}: {built.total_params:,} params, {built.trainable_params:,} "
        f"trainable ({trainable_pct:.2f}%), {resolved.method}, weights in {str(built.load_dtype).removeprefix('torch.')}",
        f"  engine       {spec.describe_engine()}, precision {t.precision}, clip {t.max_grad_norm or 'off'}",
        f"  engine file  {engine_file}",
        f"  data         {describe_data(cfg.data.path, stats, cfg.data.max_seq_len)}, {sampler.steps_per_epoch} steps/epoch",
        *([f"  eval         {describe_eval(cfg, data.eval_stats)}"] if data.eval_stats is not None else []),
        f"  grad sync    {spec.describe_grad_sync()}",
        f"  compute      {describe_compute(cfg, built.model)}",
        f"  optimizer    {spec.describe_optimizer(o.name)}, lr {lr}, {spec.describe_schedule(s.name, s.warmup_steps)}",
        f"  steps        {describe_steps(cfg, sampler.steps_per_epoch)}",
        f"  checkpoints  {describe_checkpoints(cfg, data.eval_stats is not None)}",
        f"  timeout      {describe_timeout(cfg, plan.dp_size)}",
        f"  run dir      {resolved.run_dir}",
    ]
    if plan.dp_size > 1:
        lines.append(
            f"  storage      output_dir {cfg.output_dir!r} is shared by all {plan.dp_size} ranks (checked): each "
            "writes its part of every checkpoint there, so on several nodes it must be a shared filesystem"
        )
    lines += [f"  note         {note}" for note in resolved.notes]
    if sampler.remainder and sampler.partial_window == "drop":
        lines.append(
            f"  note         partial window 'drop': the last {sampler.remainder} of {stats.n_examples} examples "
            "of every epoch's order are not trained on (set train.partial_window=normalize to use them)"
        )
    return "\n".join(lines)


def describe_steps(cfg: ZerofitConfig, steps_per_epoch: int) -> str:
    """`60 optimizer steps (train.epochs 3 x 20 steps/epoch)`, or `20 optimizer steps (~0.33 epochs)`."""
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
            f"; early stopping after {es.patience} evaluation(s) without an eval/loss improvement of more "
            f"than {es.min_delta:g}"
        )
    return text


def describe_checkpoints(cfg: ZerofitConfig, has_eval: bool) -> str:
    """The save and keep policy: `every 30 min and at the end, keep last 2 + best eval/loss`."""
    c = cfg.checkpoint
    when = [f"every {c.every_steps} steps"] if c.every_steps else []
    if c.every_minutes:
        when.append(f"every {c.every_minutes:g} min")
    when.append("at the end")
    keep = f"keep last {c.keep_last}"
    if c.keep_best and has_eval:
        keep += " + best eval/loss (saved at each new best)"
    return f"{' and '.join(when)} (and when stopped), {keep}"


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
    from zerofit.recompute import checkpointed_layers, describe_checkpointing

    layers = int(model.config.num_hidden_layers)  # peft forwards `.config` to the wrapped HF model
    n = checkpointed_layers(cfg.train.activation_checkpointing, layers)
    loss = cfg.train.cross_entropy
    if loss == "fused_linear":
        from zerofit.fused_loss import describe_fused

        device = next(model.parameters()).device.type
        loss += f" ({describe_fused(int(model.config.vocab_size), device)})"
    text = f"activation checkpointing: {describe_checkpointing(n, layers)}, {loss} cross-entropy"
    tokens = cfg.batch.tokens_per_micro_batch
    if tokens is not None:
        rows = cfg.batch.micro_batch_size
        text += (
            f", token budget {tokens} per micro-batch ({rows} packed rows of {cfg.data.max_seq_len}; "
            "micro = rows, accum = at most)"
        )
    return text


def describe_data(path: str, stats: DataStats, max_seq_len: int) -> str:
    """`data/x.jsonl [messages, detected]: 3,000 examples (2 truncated to 512 tokens, 3 dropped: 3 for an
    empty response)`."""
    how = [stats.format + (", detected" if stats.detected else "")]
    if stats.from_cache:
        how.append("from the tokenization cache")
    notes = f"{stats.n_truncated} truncated to {max_seq_len} tokens, {stats.n_dropped} dropped"
    if stats.n_empty and stats.empty_responses == "drop":
        notes += f": {stats.n_empty} for an empty response"
    elif stats.n_empty:
        notes += (
            f", {stats.n_empty} with an empty response kept (data.empty_responses=keep: they learn eos only)"
        )
    if stats.n_split:
        notes += f", {stats.n_split} long texts split"
    return f"{path} [{'; '.join(how)}]: {stats.n_examples:,} examples ({notes})"


def describe_eval(cfg: ZerofitConfig, stats: DataStats) -> str:
    """Where the evaluation data comes from and when the loss is computed."""
    d = cfg.data
    if d.eval_path is not None:
        source = d.eval_path
    elif isinstance(d.eval_split, str):
        source = f"split {d.eval_split!r} of {d.path}"
    else:
        source = f"{d.eval_split:g} of {d.path}'s records held out"
    when = f"every {cfg.eval.every_steps} steps and at the end" if cfg.eval.every_steps else "at the end"
    return f"{stats.n_examples:,} examples ({source}), loss {when}"


def loss_summary(losses: list[float]) -> str:
    """Start and end loss, each a mean over a few steps (one global batch's loss is noisy)."""
    k = max(1, min(10, len(losses) // 2))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return f"loss {first:.4f} -> {last:.4f} (mean of the first / last {k} steps)"


def announce(run: PreparedRun) -> None:
    """Rank 0 writes config.yaml + the engine config and prints the plan; every rank waits for it."""
    if run.strategy.rank == 0:
        say(format_plan(run, write_run_files(run)))
    run.strategy.barrier()


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended: its exit code, run directory (after any `-2` suffix) and final export."""

    exit_code: int
    run_dir: Path
    export_dir: Path | None = None


def train_run(
    resolved: ResolvedConfig, config_path: str | None, stop: StopSignal | None = None
) -> RunOutcome:
    """Build everything for a resolved config and train it (`zerofit.api.train` calls it in-process). The
    exit code is 128 + the signal when a SIGTERM/SIGINT stopped the run (after a checkpoint)."""
    quiet_libraries()
    from zerofit.assembly import assemble
    from zerofit.checkpoint import Checkpointer, checkpoint_record, export_final
    from zerofit.checkpoint.policy import EvalWatch
    from zerofit.checkpoint.resume import restore, resume_message
    from zerofit.metrics.setup import open_sinks
    from zerofit.metrics.summary import record_outcome
    from zerofit.train import train_loop

    stop = stop or StopSignal()
    asked_name = resolved.config.run_name
    run = assemble(resolved)
    try:
        resolved, strategy, point = run.resolved, run.strategy, run.resume
        cfg, rank = resolved.config, strategy.rank
        record = checkpoint_record(resolved, strategy.checkpoint_format) if rank == 0 else None
        elapsed = point.elapsed_s if point else 0.0
        assert cfg.train.max_steps is not None, "the data settles train.max_steps of a train.epochs run"
        es = cfg.train.early_stopping
        has_eval = run.data is not None and run.data.eval_examples is not None
        watch = EvalWatch(es.patience, es.min_delta) if has_eval else None
        checkpointer = Checkpointer(
            strategy, resolved.run_dir, cfg.checkpoint, cfg.train.max_steps, record, elapsed, watch=watch
        )
        start_step, history = restore(checkpointer, point, resolved.run_dir)
        if watch is not None:  # a resumed run's best and patience, from the evaluations it kept
            watch.replay(history or [])
        if point is not None:  # changes the resume accepted, trained with (not the loaded values)
            strategy.apply_config(cfg, resolved.effective_lr, cfg.train.max_steps)
        stop.arm(str(resolved.run_dir))  # from here on a signal stops after a step, with a checkpoint
        announce(run)
        message = resume_message(point, cfg.checkpoint.resume, resolved.run_dir, cfg.train.max_steps)
        if message:
            say(message, rank=rank)
        sink = open_sinks(
            resolved,
            run.spec,
            rank,
            run.record(),
            config_path=config_path,
            history=history,
            prior_wall_s=elapsed,
        )
        try:
            loop = run.train_run(sink, checkpointer, stop, clock=checkpointer.clock, watch=watch)
            results = train_loop(loop, start_step)
            steps_done = start_step + len(results)
            stopped = stop.agreed is not None and steps_done < cfg.train.max_steps
            if stopped:
                stop.stopped()  # the stop checkpoint is written: later signals change nothing
            exported = (
                export_final(strategy, run.built.tokenizer, resolved.run_dir)
                if cfg.checkpoint.save_final and not stopped
                else None
            )
        finally:
            sink.close()
        early = watch is not None and watch.stopped_at is not None
        if rank == 0:
            record_outcome(resolved.run_dir, _outcome_fields(stopped, early, watch, stop))
        losses = [row["loss"] for row in history or [] if row.get("loss") is not None]
        losses += [r.loss for r in results]
        if stopped:
            strategy.barrier()  # every rank's files (and rank 0's summary) are on disk before anyone exits
            assert stop.agreed is not None
            again = " checkpoint.resume=true" + (
                f" run_name={cfg.run_name}" if cfg.run_name != asked_name else ""
            )
            say(
                f"zerofit: stopped by {signal.Signals(stop.agreed).name} after step {steps_done} of "
                f"{cfg.train.max_steps}; checkpoint {checkpointer.root / f'step-{steps_done}'}; resume with the same "
                f"command plus{again}",
                rank=rank,
            )
            return RunOutcome(StopSignal.exit_code(stop.agreed), resolved.run_dir)
        if early:
            assert watch is not None
            say(f"zerofit: {watch.stop_line()}", rank=rank)
        if losses:
            say(f"done: {steps_done} steps, {loss_summary(losses)}", rank=rank)
        if watch is not None and watch.best_step is not None:
            say(best_line(watch, checkpointer.root, cfg.checkpoint.keep_best), rank=rank)
        say(f"results: {resolved.run_dir}" + (f" (export: {exported})" if exported else ""), rank=rank)
        # Leave together: a rank that tears gloo down while a peer still has work in flight can abort
        # that peer after a successful run. (Only on success: after an error, ranks may not all get here.)
        strategy.barrier()
        return RunOutcome(0, resolved.run_dir, exported)
    finally:
        run.close()


def _outcome_fields(stopped: bool, early: bool, watch: EvalWatch | None, stop: StopSignal) -> dict[str, Any]:
    """How the run ended, for summary.json: `stop_reason` (max_steps, early_stopping or the signal) and
    the best evaluation."""
    if stopped and stop.agreed is not None:
        reason = signal.Signals(stop.agreed).name
    else:
        reason = "early_stopping" if early else "max_steps"
    fields: dict[str, Any] = {"stop_reason": reason, "early_stopped": early}
    if watch is not None:
        fields |= {"best_step": watch.best_step, "best_eval_loss": watch.best_loss}
    return fields


def best_line(watch: EvalWatch, checkpoints: Path, keep_best: bool) -> str:
    """`best: eval/loss 1.2345 at step 40 (checkpoint ..., export it with zerofit export RUN --step best)`."""
    text = f"best: eval/loss {watch.best_loss:.4f} at step {watch.best_step}"
    folder = checkpoints / f"step-{watch.best_step}"
    if keep_best and folder.is_dir():
        text += f" (checkpoint {folder}; zerofit export {checkpoints.parent} --step best --out DIR)"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `launchers/launch_finetune.py`; returns the process exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    line_buffered_output()  # step lines reach a log file (nohup, SLURM, `> log`) as they are printed
    env = launch_env()
    # SIGTERM/SIGINT stop the run cleanly from here on (no KeyboardInterrupt traceback); a launched worker
    # also exits when its launcher dies (the deepspeed runner included, not only its launch.py).
    stop = StopSignal(env.rank).install()
    if env.launched:
        die_with_parent()
        die_with_launcher(stop, rank=env.rank)  # under `deepspeed`, the parent is launch.py: watch the runner
    try:
        resolved = resolve_for_launch(load_config(args.config, args.overrides), env)
        return train_run(resolved, args.config, stop).exit_code
    except ZerofitError as exc:
        # One paragraph, every rank, no traceback: the message names the field, the rule and the fix.
        error(f"zerofit (rank {env.rank})", exc)
        return EXIT_USER_ERROR
