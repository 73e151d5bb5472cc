"""The body of `launchers/launch_finetune.py`: parse -> resolve -> `FinetuneRecipe` (setup: assemble the run
plan, engine, data and model, restore, print the plan; train; cleanup).

Order matters for the user: the config is resolved against the launcher's world size before anything heavy
is imported, so a batch that does not divide fails in a fraction of a second; the run is assembled
(`zerofit.recipe.assembly`: spec, engine, data, model) and any checkpoint restored before the run directory is
written, so a user error never writes into any run directory. Every `ZerofitError` becomes one paragraph
on stderr and exit code 2 on every rank, without a traceback; a rank whose peer stopped mid-run says which
one, the checkpoint kept and the resume command (`zerofit.recipe.lost_rank`, exit code 75).
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

from zerofit.config import ZerofitConfig, load_config
from zerofit.core.errors import ConfigError, LaunchError, PeerLost, RunFinished, ZerofitError
from zerofit.core.messages import error, line_buffered_output, quiet_libraries, say
from zerofit.core.progress import progress
from zerofit.core.run_layout import RunLayout, step_dir_name
from zerofit.loop.signals import StopSignal, deepspeed_runner, die_with_launcher, die_with_parent
from zerofit.metrics.keys import LOSS, harness_field
from zerofit.objectives.registry import objective_of
from zerofit.planner import choose_fastest_plan
from zerofit.recipe.lost_rank import EXIT_PEER_LOST, peer_lost
from zerofit.recipe.run_report import best_line, format_plan
from zerofit.recipe.vision_settings import names_vision_model, refuse_vision_settings
from zerofit.resolution import ResolvedConfig, resolve
from zerofit.strategies.env import LaunchEnv, launch_env
from zerofit.strategies.peers import collective_failure

if TYPE_CHECKING:
    from zerofit.checkpoint.policy import EvalWatch
    from zerofit.metrics.base import MetricsSink
    from zerofit.metrics.summary import Trend
    from zerofit.objectives.spec import ObjectiveSpec
    from zerofit.recipe.assembly import PreparedRun

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
        # Said here, once, rather than by each rank when its data loads, and before the planner's search (a
        # setting a vision model cannot take is refused as itself, not as "nothing fits").
        if names_vision_model(cfg):
            refuse_vision_settings(cfg, objective_of(cfg))
        return resolve(cfg, env.world_size, choose_fastest_plan)
    except ConfigError:
        hint = None if env.launched else _python_launch_hint(cfg)
        if hint is None:
            raise
        raise LaunchError(hint) from None


def write_run_files(run: PreparedRun) -> Path:
    """`config.yaml` (the run plan's config) and the engine config exactly as the engine receives it (rank 0)."""
    plan = run.plan
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    layout = RunLayout(plan.run_dir)
    layout.config.write_text(yaml.safe_dump(plan.config.model_dump(mode="json"), sort_keys=False))
    engine_file = layout.engine_file(plan.spec.strategy)
    engine_file.write_text(json.dumps(plan.spec.to_json(), indent=2) + "\n")
    return engine_file


def announce(run: PreparedRun) -> None:
    """Rank 0 writes config.yaml + the engine config and prints the plan; every rank waits for it (a full
    disk: one paragraph on every rank, `rank0_writes`)."""
    from zerofit.checkpoint.failed_save import rank0_writes

    engine_file = rank0_writes(run.strategy, run.plan.run_dir, lambda: write_run_files(run))
    if engine_file is not None:
        say(format_plan(run, engine_file))
    run.strategy.barrier()


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended: its exit code, run directory (after any `-2` suffix) and final export."""

    exit_code: int
    run_dir: Path
    export_dir: Path | None = None


class FinetuneRecipe:
    """One training run in a torchtune recipe's shape: `setup` builds it (the run plan, engine, data and
    model through `assemble`, the checkpoint restored, the plan printed, the sinks opened), `train` trains
    and exports, `cleanup` releases the sinks and the process group. `run_training` calls the three."""

    def __init__(self, resolved: ResolvedConfig, config_path: str | None, stop: StopSignal | None) -> None:
        self.resolved = resolved
        self.config_path = config_path
        self.stop = stop or StopSignal()
        self.run: PreparedRun | None = None
        self.sink: MetricsSink | None = None

    def setup(self) -> None:
        """Assemble the run, restore its checkpoint, print its plan and open its metrics sinks."""
        quiet_libraries()
        from zerofit.checkpoint import Checkpointer, checkpoint_record
        from zerofit.checkpoint.resume import restore, resume_message
        from zerofit.metrics.setup import open_sinks
        from zerofit.recipe.assembly import assemble

        self.run = run = assemble(self.resolved, config_file=self.config_path)
        # A GRPO run's reward functions are imported now, before its files are written and its plan printed:
        # a `module:function` that cannot be imported is refused like any config error, with nothing written.
        self.rollouts = run.rollouts
        if run.harness is not None:  # eval.harness: its tasks resolved (a hub task's data fetched) first
            run.harness.prepare()
        plan, strategy = run.plan, run.strategy
        cfg, rank, point = plan.config, strategy.rank, plan.resume
        assert cfg.train.max_steps is not None, "a run plan knows its step count"
        fmt = strategy.checkpoint_format
        record = checkpoint_record(plan, fmt, self.config_path) if rank == 0 else None
        elapsed = point.elapsed_s if point else 0.0
        has_eval = run.data is not None and run.data.eval_examples is not None
        self.watch = eval_watch(cfg, plan.objective, has_eval)
        self.checkpointer = Checkpointer(
            strategy, plan.run_dir, cfg.checkpoint, cfg.train.max_steps, record, elapsed, watch=self.watch
        )
        self.start_step, self.history = restore(self.checkpointer, point, plan.run_dir)
        if self.watch is not None:  # a resumed run's best and patience, from the evaluations it kept
            self.watch.replay(self.history or [])
        if point is not None:  # changes the resume accepted, trained with (not the loaded values)
            strategy.apply_config(cfg, plan.effective_lr, cfg.train.max_steps)
        self.stop.arm(str(plan.run_dir))  # from here on a signal stops after a step, with a checkpoint
        announce(run)
        message = resume_message(point, cfg.checkpoint.resume, plan.run_dir, cfg.train.max_steps)
        if message:
            say(message, rank=rank)
        from zerofit.checkpoint.failed_save import rank0_writes
        from zerofit.metrics.base import NullSink

        def opened() -> MetricsSink:
            return open_sinks(
                plan,
                rank,
                run.record(),
                config_path=self.config_path,
                history=self.history,
                prior_wall_s=elapsed,
                under_deepspeed_launcher=deepspeed_runner() is not None,
            )

        # run_info.json (and W&B's run id) on rank 0; the other ranks get a NullSink.
        sinks = rank0_writes(strategy, plan.run_dir, opened)
        self.sink = sinks if sinks is not None else NullSink()

    def train(self) -> RunOutcome:
        """Train to `train.max_steps` (or a stop / early stop), export, and say how the run ended. The exit
        code is 128 + the signal when a SIGTERM/SIGINT stopped the run (after a checkpoint)."""
        from zerofit.checkpoint import export_final
        from zerofit.loop.train import train_loop
        from zerofit.metrics.summary import judged_series, judged_trends, record_outcome

        assert self.run is not None and self.sink is not None, "setup() first"
        run, plan, stop, watch = self.run, self.run.plan, self.stop, self.watch
        cfg, strategy = plan.config, run.strategy
        assert cfg.train.max_steps is not None
        loop = run.loop_inputs(self.sink, self.checkpointer, stop, clock=self.checkpointer.clock, watch=watch)
        results = train_loop(loop, self.start_step, self._tokens_before())
        steps_done = self.start_step + len(results)
        # A signal during the step that ran out early stopping's patience: the run is finished, so it ends
        # (exported) as an early stop, not as a stop to resume (which would train on past the stop).
        early = watch is not None and watch.stopped_at is not None
        stopped = stop.agreed is not None and steps_done < cfg.train.max_steps and not early
        if stop.agreed is not None:
            stop.stopped()  # the stop checkpoint is written: later signals change nothing
        exported = None
        if cfg.checkpoint.save_final and not stopped:
            exported = export_final(strategy, run.built.tokenizer, plan.run_dir, cfg)
        self._close_sink()  # summary.json is complete before the outcome is added to it
        if strategy.rank == 0:
            record_outcome(plan.run_dir, _outcome_fields(stopped, early, watch, stop))
        if stopped:
            return self._stopped(steps_done)
        rows = [*(self.history or []), *({LOSS: r.loss, **r.metrics} for r in results)]
        self._say_end(steps_done, judged_trends(judged_series(rows)), early, exported)
        # Leave together: a rank that tears gloo down while a peer still has work in flight can abort
        # that peer after a successful run. (Only on success: after an error, ranks may not all get here.)
        strategy.barrier()
        return RunOutcome(0, plan.run_dir, exported)

    def _tokens_before(self) -> int:
        """The valid label tokens of the steps a resume does not train again: its checkpoint's count, or,
        for a checkpoint older than that record, the kept metrics rows' (rank 0's; short of the unlogged
        steps under `logging.log_every` > 1, as such a run's own rows were)."""
        from zerofit.metrics.summary import tokens_seen_through

        assert self.run is not None
        point = self.run.plan.resume
        if point is None or self.start_step == 0:
            return 0
        if point.tokens_seen is not None:
            return point.tokens_seen
        return int(tokens_seen_through(self.history or []))

    def cleanup(self) -> None:
        """Close the sinks (if `train` did not get to) and tear the engine's process group down."""
        self._close_sink()
        if self.run is not None:
            self.run.close()

    def _close_sink(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None

    def _stopped(self, steps_done: int) -> RunOutcome:
        """A run stopped by a signal: every rank's files on disk, then how to resume it."""
        assert self.run is not None and self.stop.agreed is not None
        plan, strategy = self.run.plan, self.run.strategy
        strategy.barrier()  # every rank's files (and rank 0's summary) are on disk before anyone exits
        say(
            f"zerofit: stopped by {signal.Signals(self.stop.agreed).name} after step {steps_done} of "
            f"{plan.config.train.max_steps}; checkpoint "
            f"{self.checkpointer.root / step_dir_name(steps_done)}; resume with the same command "
            f"plus{self._resume_args()}",
            rank=strategy.rank,
        )
        return RunOutcome(StopSignal.exit_code(self.stop.agreed), plan.run_dir)

    def _resume_args(self) -> str:
        """What the launch command adds to resume this run: `checkpoint.resume=true`, and the run's name
        when a new run took `-2` (the command's own name is the other run's)."""
        again = " checkpoint.resume=true"
        if self.run is not None and self.run.plan.run_name != self.resolved.config.run_name:
            again += f" run_name={self.run.plan.run_name}"
        return again

    def lost_peer(self, exc: BaseException) -> PeerLost | None:
        """`exc` as the paragraph of a peer rank that stopped (`zerofit.recipe.lost_rank`), or None when it is
        no collective's failure to reach a peer (any other error stays as it is, even with a peer gone: that
        peer may have exited after its own error); from then on the launcher's SIGTERM changes nothing."""
        env = launch_env()
        cause = collective_failure(exc) if env.world_size > 1 else None
        if cause is None:
            return None
        self.stop.stopped()  # the launcher now ends this rank (SIGTERM): say why, not "stopping after the step"
        run = self.run
        processes = run.strategy.processes if run is not None else []
        run_dir = run.plan.run_dir if run is not None else None
        return peer_lost(cause, env.rank, processes, run_dir, self._resume_args())

    def _say_end(self, steps_done: int, trends: list[Trend], early: bool, exported: Path | None) -> None:
        """The end of a finished run: early stop, where what it is judged by went (GRPO's reward, a preference
        run's reward accuracy and margin, KTO's KL, SFT's loss: `metrics.keys.JUDGED_BY`), the best
        evaluation, where the results are."""
        assert self.run is not None
        plan, rank, watch = self.run.plan, self.run.strategy.rank, self.watch
        if early:
            assert watch is not None
            say(f"zerofit: {watch.stop_line()}", rank=rank)
        if trends:
            from zerofit.metrics.summary import describe_trends

            say(f"done: {steps_done} steps, {describe_trends(trends)}", rank=rank)
        if watch is not None and watch.best_step is not None:
            say(best_line(watch, self.checkpointer.root, plan.config.checkpoint.keep_best), rank=rank)
        say(f"results: {plan.run_dir}" + (f" (export: {exported})" if exported else ""), rank=rank)


def run_training(
    resolved: ResolvedConfig, config_path: str | None, stop: StopSignal | None = None
) -> RunOutcome:
    """Build everything for a resolved config and train it: setup, train, cleanup (`zerofit.api.train`
    calls it in-process, the launcher through `main`)."""
    recipe = FinetuneRecipe(resolved, config_path, stop)
    try:
        # Up to the plan: the engine, the built-in model, the data, the model, the optimizer (each of its
        # own long parts reports inside this one: DeepSpeed's first compile, a conversion, tokenizing).
        with progress("setting up the run", enabled=launch_env().rank == 0):
            recipe.setup()
        return recipe.train()
    except Exception as exc:
        lost = recipe.lost_peer(exc)  # another rank stopped: one paragraph, not the collective's traceback
        if lost is None:
            raise
        raise lost from None
    finally:
        recipe.cleanup()


def eval_watch(cfg: ZerofitConfig, objective: ObjectiveSpec, has_eval: bool) -> EvalWatch | None:
    """The run's watch over its evaluations (best checkpoint, early stopping): with evaluation data, of the
    objective's followed metric (eval/loss, lower is better; an RL objective's eval/reward, higher is
    better), or of `eval.harness.best_metric`'s lm-eval score (higher is better) whenever it is set."""
    from zerofit.checkpoint.policy import EvalWatch, followed_metric

    es, best = cfg.train.early_stopping, cfg.eval.harness.best_metric
    if best is not None:
        task, _, metric = best.rpartition("/")
        return EvalWatch(es.patience, es.min_delta, harness_field(task, metric), higher=True)
    return EvalWatch(es.patience, es.min_delta, followed_metric(objective)) if has_eval else None


def _outcome_fields(stopped: bool, early: bool, watch: EvalWatch | None, stop: StopSignal) -> dict[str, Any]:
    """How the run ended, for summary.json: `stop_reason` (max_steps, early_stopping or the signal) and
    the best evaluation."""
    if stopped and stop.agreed is not None:
        reason = signal.Signals(stop.agreed).name
    else:
        reason = "early_stopping" if early else "max_steps"
    fields: dict[str, Any] = {"stop_reason": reason, "early_stopped": early}
    if watch is not None:
        fields |= {"best_step": watch.best_step, watch.summary_field: watch.best_value}
    return fields


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
    resolved = None
    try:
        resolved = resolve_for_launch(load_config(args.config, args.overrides), env)
        return run_training(resolved, args.config, stop).exit_code
    except RunFinished as exc:
        # A finished run resumed under checkpoint.resume=auto (a requeue): nothing to do, not a failure.
        say(f"zerofit: {exc}", rank=env.rank)
        return 0
    except ZerofitError as exc:
        # One paragraph, no traceback: the message names the field, the rule and the fix; once per run.
        if prints_error(exc, env, from_config=resolved is None):
            error(f"zerofit (rank {env.rank})", exc)
        elif env.launched:
            leave_after_the_rank_that_says_it(stop)
        return EXIT_PEER_LOST if isinstance(exc, PeerLost) else EXIT_USER_ERROR


def prints_error(exc: ZerofitError, env: LaunchEnv, *, from_config: bool) -> bool:
    """Whether this rank prints `exc`, so that a user error is said once per run, not once per rank.

    An error every rank raised from agreed values (`exc.agreed`: a refusal rank 0 decided and broadcast,
    such as a resume refused for a changed config) is said by rank 0. One raised reading and resolving the
    config (`from_config`: the file, the overrides and the world size, before any rank talks to another) is
    the same on every rank that reads the same files: local rank 0 says it, once per node (a node without
    the file still says why). Anything else may be one rank's own, and every rank that raises it says it.
    """
    if exc.agreed:
        return env.rank == 0
    if from_config:
        return env.local_rank == 0
    return True


# How long a rank that keeps a user error to itself waits for its launcher to end it (see below).
SILENT_RANK_WAIT_S = 30.0


def leave_after_the_rank_that_says_it(stop: StopSignal, wait_s: float = SILENT_RANK_WAIT_S) -> None:
    """A rank that does not print a user error (another rank says it, `prints_error`) exits only after that
    rank: DeepSpeed's launch.py ends every rank as soon as one exits non-zero, so a silent rank leaving first
    ended the rank about to print, and the launch failed with exit code 2 and no message (seen in CI). The
    printing rank raised the same error; when it exits, the launcher (launch.py, torchrun) stops this one:
    a signal before training exits at once (`StopSignal`), one during training is a stop request, which
    ends the wait. `wait_s` bounds the wait should no signal come."""
    import time

    deadline = time.monotonic() + wait_s
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.05)
