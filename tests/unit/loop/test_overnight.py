"""Overnight defaults in one process: train.epochs (the exact step count, one config-level rule), the
wall-clock save interval agreed through the loop's one all-reduce, the best checkpoint kept beyond
keep_last, early stopping on eval/loss, distributed.timeout_minutes in the engine spec, and one real
tiny-llama run that stops early, keeps and exports its best checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from config_helpers import DEMO_DATA, one_process_strategy, prepared_one_process_strategy
from zerofit.checkpoint import Checkpointer, complete_checkpoints
from zerofit.checkpoint.policy import EvalWatch, SaveClock, Verdict, read_best, resolve_step
from zerofit.config import load_config
from zerofit.config.schema import CheckpointSection
from zerofit.core.errors import ConfigError
from zerofit.data import GlobalBatchSampler
from zerofit.engine_spec import render_spec
from zerofit.engine_spec.run_plan import DataFacts, make_run_plan
from zerofit.loop.signals import StopSignal
from zerofit.loop.train import LoopInputs, agree_after_step
from zerofit.resolution import resolve


def _resolve(*overrides: str) -> Any:
    base = [
        f"data.path={DEMO_DATA}",
        "distributed.strategy=single",
        "batch.global_batch_size=16",
        "batch.micro_batch_size=4",
    ]
    return resolve(load_config(None, [*base, *overrides]), 1)


# --- train.epochs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "window", "epochs", "steps"), [(70, "drop", 3, 12), (70, "normalize", 3, 15)])
def test_epochs_become_exact_steps_under_the_last_window_rule(
    n: int, window: str, epochs: int, steps: int
) -> None:
    resolved = _resolve(f"train.epochs={epochs}", f"train.partial_window={window}")
    assert resolved.config.train.max_steps is None  # unknown until the data is loaded
    sampler = GlobalBatchSampler(n, 16, seed=0, partial_window=window)  # type: ignore[arg-type]
    facts = DataFacts(format="prompt_response", steps_per_epoch=sampler.steps_per_epoch)
    settled = make_run_plan(resolved, render_spec(resolved), data=facts).config.train
    assert (settled.epochs, settled.max_steps) == (epochs, steps)  # 70 // 16 = 4 (+1 partial) per epoch
    assert sampler.epoch_of(steps - 1) == epochs - 1 and sampler.epoch_of(steps) == epochs


def _two_epoch_run_saved_at(step: int, where: tuple[str, ...]) -> tuple[Any, Any]:
    """A `train.epochs=2` run over the demo data (2 x 187 steps) with a checkpoint at `step`: its resolved
    launch and the one-process strategy that saved it."""
    from zerofit.checkpoint import checkpoint_record

    launch = _resolve("train.epochs=2", *where)
    per_epoch = GlobalBatchSampler(3000, 16, seed=42).steps_per_epoch
    saved = make_run_plan(launch, render_spec(launch), data=DataFacts("prompt_response", per_epoch))
    strategy = prepared_one_process_strategy()
    record = checkpoint_record(saved, strategy.checkpoint_format)
    assert record["config"]["train"]["max_steps"] == 2 * 187
    Checkpointer(strategy, launch.run_dir, CheckpointSection(), max_steps=374, record=record).save(step)
    return launch, strategy


def test_an_epochs_run_resumes_on_its_epochs_and_data_not_on_the_derived_step_count(tmp_path: Path) -> None:
    from zerofit.checkpoint.resume import find_resume_point
    from zerofit.core.errors import ResumeError

    where = (f"output_dir={tmp_path}", "run_name=r")
    launch, strategy = _two_epoch_run_saved_at(5, where)
    # The relaunch's max_steps is still unknown (the data loads later): the same epochs resume.
    assert find_resume_point(launch, strategy.checkpoint_format) is not None
    with pytest.raises(ResumeError, match=r"train.epochs: 2 -> 3"):
        find_resume_point(_resolve("train.epochs=3", *where), strategy.checkpoint_format)


def test_max_steps_and_epochs_are_one_or_the_other() -> None:
    assert _resolve().config.train.max_steps == 20  # neither set: the default length
    with pytest.raises(ConfigError) as err:
        _resolve("train.epochs=2", "train.max_steps=10")
    assert "train.max_steps = 10 and train.epochs = 2 are both set" in str(err.value)
    with pytest.raises(ConfigError, match=r"train.epochs = 0: must be > 0"):
        _resolve("train.epochs=0")


def test_early_stopping_without_evaluations_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"train.early_stopping.patience = 3 .* no evaluation data; set data"
    ):
        _resolve("train.early_stopping.patience=3")
    with pytest.raises(ConfigError, match=r"eval.every_steps = 0 evaluates only at the end"):
        _resolve("train.early_stopping.patience=3", "data.eval_split=0.1")
    _resolve("train.early_stopping.patience=3", "data.eval_split=0.1", "eval.every_steps=5")


def test_the_process_group_timeout_reaches_the_engine() -> None:
    assert render_spec(_resolve()).timeout_minutes == 30.0
    strategy = one_process_strategy()
    assert strategy.pg_timeout.total_seconds() == 1800.0
    assert render_spec(_resolve("distributed.timeout_minutes=2.5")).timeout_minutes == 2.5
    with pytest.raises(ConfigError, match=r"distributed.timeout_minutes = 0.0: must be > 0"):
        _resolve("distributed.timeout_minutes=0")


# --- the decisions ----------------------------------------------------------------------------------------


def test_early_stopping_counts_evaluations_without_an_improvement_beyond_min_delta() -> None:
    watch = EvalWatch(patience=2, min_delta=0.1)
    seen = []
    for step, loss in enumerate([3.0, 2.5, 2.45, 2.3, 2.35, 2.25], start=1):
        verdict = watch.judge(loss)
        watch.record(step, loss, verdict)
        seen.append((verdict.best, verdict.exhausted))
    # 2.45 and 2.35 are within min_delta of the best; 2.3 improves on 2.5 by 0.2 and resets the count.
    assert seen == [
        (True, False),
        (True, False),
        (False, False),
        (True, False),
        (False, False),
        (False, True),
    ]
    assert (watch.best_step, watch.best_value, watch.stopped_at) == (4, 2.3, 6)
    assert "stopped after step 6" in watch.stop_line()
    resumed = EvalWatch(patience=2, min_delta=0.1)  # a resume replays the kept rows: same best, same count
    resumed.replay([{"step": 1, "loss": 9.0}, {"step": 2, "eval/loss": 3.0}, {"step": 4, "eval/loss": 2.95}])
    assert (resumed.best_step, resumed.since_best) == (2, 1) and resumed.judge(2.95).exhausted


def test_an_rl_objective_follows_its_held_out_reward_higher_is_better() -> None:
    """GRPO's evaluation is eval/reward: a higher value is the better one (by more than min_delta), a lower
    one counts toward the patience; SFT's stays eval/loss, lower is better. The summary field follows."""
    from zerofit.checkpoint.policy import followed_metric
    from zerofit.objectives.registry import OBJECTIVES

    assert followed_metric(OBJECTIVES["grpo"]) == "eval/reward"
    assert followed_metric(OBJECTIVES["sft"]) == followed_metric(OBJECTIVES["dpo"]) == "eval/loss"
    watch = EvalWatch(patience=2, min_delta=0.05, metric="eval/reward")
    for step, reward in enumerate([0.1, 0.4, 0.42, 0.3, 0.5], start=1):
        watch.record(step, reward, watch.judge(reward))
    assert (watch.best_step, watch.best_value, watch.since_best) == (5, 0.5, 0)
    assert watch.judge(0.2).best is False and watch.summary_field == "best_eval_reward"
    resumed = EvalWatch(metric="eval/reward")
    resumed.replay([{"step": 1, "eval/reward": 0.2, "eval/loss": 9.0}, {"step": 2, "eval/reward": 0.1}])
    assert (resumed.best_step, resumed.best_value) == (1, 0.2)
    assert EvalWatch().summary_field == "best_eval_loss"


def test_the_save_clock_runs_from_the_last_save() -> None:
    now = [0.0]
    clock = SaveClock(30, now=lambda: now[0])
    now[0] = 1799.0
    assert not clock.due()
    now[0] = 1800.0
    assert clock.due()
    clock.reset()
    assert not clock.due()
    assert not SaveClock(0, now=lambda: 1e9).due() and not SaveClock(None).due()


def _agreement_run(rank: int, clock: SaveClock | None, watch: EvalWatch | None) -> LoopInputs:
    strategy = one_process_strategy()
    strategy.rank = rank  # one process: the all-reduce is the identity, so this rank's votes are the sum
    stop = StopSignal(rank)
    return LoopInputs(
        strategy, None, [], None, None, 1, None, 0, None, None, stop=stop, clock=clock, watch=watch
    )  # type: ignore[arg-type]


def test_only_rank_0s_clock_and_verdict_count_in_the_agreement() -> None:
    due = SaveClock(1, now=iter([0.0, 1e6, 1e6]).__next__)
    first = agree_after_step(_agreement_run(0, due, EvalWatch(1)), eval_loss=2.0)
    assert (first.stopping, first.timed, first.verdict) == (False, True, Verdict(True, False))
    assert first.save(keep_best=False)  # the timed save
    # Another rank's clock and judgement add nothing: the sum over ranks is rank 0's alone.
    other = agree_after_step(
        _agreement_run(1, SaveClock(1, now=iter([0.0, 1e6]).__next__), EvalWatch(1)), 2.0
    )
    assert (other.timed, other.verdict) == (False, Verdict(False, False)) and not other.save(keep_best=True)
    no_eval = agree_after_step(_agreement_run(0, None, EvalWatch(1)), eval_loss=None)
    assert no_eval.verdict is None and not no_eval.save(keep_best=True)


# --- keep_best ---------------------------------------------------------------------------------------------


def test_the_best_checkpoint_outlives_keep_last_and_is_what_step_best_names(tmp_path: Path) -> None:
    strategy = prepared_one_process_strategy()
    watch = EvalWatch()
    section = CheckpointSection(every_steps=1, keep_last=1, every_minutes=None)
    ckpt = Checkpointer(strategy, tmp_path, section, max_steps=5, watch=watch)
    for step, loss in enumerate([3.0, 2.0, 2.5, 2.6, 2.7], start=1):
        watch.record(step, loss, watch.judge(loss))
        ckpt.after_step(step, watch.best_step == step)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 5]  # keep_last 1 + the best
    assert read_best(tmp_path / "checkpoints") == {
        "step": 2,
        "metric": "eval/loss",
        "value": 2.0,
        "checkpoint": "step-2",
    }
    assert resolve_step(tmp_path, "best") == 2 and resolve_step(tmp_path, 4) == 4
    with pytest.raises(ConfigError, match=r"--step best: .* has no checkpoints/best.json"):
        resolve_step(tmp_path / "elsewhere", "best")


# --- one real run -----------------------------------------------------------------------------------------


def test_a_run_stops_early_keeps_its_best_checkpoint_and_exports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import zerofit
    from zerofit.cli import main as cli

    lines = [json.dumps({"prompt": f"{i} + {i} =", "response": f" {2 * i}"}) for i in range(48)]
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(lines[40:]) + "\n")
    # min_delta 100: only the first evaluation improves, so patience 2 ends the run after step 3 of 10.
    result = zerofit.train(
        "configs/demo.yaml",
        output_dir=str(tmp_path / "runs"),
        run_name="early",
        distributed={"strategy": "single", "preset": None},
        batch__micro_batch_size=8,
        train={"max_steps": None, "epochs": 5, "early_stopping": {"patience": 2, "min_delta": 100.0}},
        data={"path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "eval.jsonl")},
        eval__every_steps=1,
        checkpoint={"keep_last": 1},
        logging={"console": False, "wandb": {"mode": "disabled"}},
    )
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "early"
    assert "10 optimizer steps (train.epochs 5 x 2 steps/epoch)" in out  # 40 // 16 = 2 full batches
    assert "early stopping: eval/loss has not improved by more than 100 for 2 evaluation(s)" in out
    assert "stopped after step 3" in out and "best: eval/loss" in out and "at step 1" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stop_reason"], summary["early_stopped"], summary["best_step"], summary["last_step"]) == (
        "early_stopping",
        True,
        1,
        3,
    )
    assert result.steps == 3 and (run_dir / "adapter").is_dir()  # the final export, as at a normal end
    assert [s for s, _ in complete_checkpoints(run_dir)] == [1, 3]  # keep_last 1 + the best
    saved = (run_dir / "config.yaml").read_text()
    assert "max_steps: 10" in saved and "epochs: 5" in saved
    assert cli(["export", str(run_dir), "--step", "best", "--out", str(tmp_path / "best")]) == 0
    assert "from checkpoint step-1" in capsys.readouterr().out
    # The model cards say the steps the weights trained for and that the run stopped early, never "10".
    card = (tmp_path / "best" / "README.md").read_text()
    assert (
        "| training | 1 of 10 optimizer steps (early stopping ended the run after step 3) of global 16"
        in card
    )
    assert cli(["export", str(run_dir), "--out", str(tmp_path / "final")]) == 0
    card = (tmp_path / "final" / "README.md").read_text()
    assert (
        "| training | 3 of 10 optimizer steps (early stopping ended the run after step 3) of global 16"
        in card
    )


# --- a finished run stays finished --------------------------------------------------------------------------


def _early_args(tmp_path: Path) -> list[str]:
    """Dotted overrides of configs/demo.yaml for a run that early-stops after step 3 of 10 (as above)."""
    lines = [json.dumps({"prompt": f"{i} + {i} =", "response": f" {2 * i}"}) for i in range(48)]
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(lines[40:]) + "\n")
    return [
        f"output_dir={tmp_path / 'runs'}",
        "run_name=early",
        "distributed.strategy=single",
        "distributed.preset=null",
        "batch.micro_batch_size=8",
        "train.max_steps=null",
        "train.epochs=5",
        "train.early_stopping.patience=2",
        "train.early_stopping.min_delta=100",
        f"data.path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'eval.jsonl'}",
        "eval.every_steps=1",
        "checkpoint.keep_last=1",
        "logging.console=false",
        "logging.wandb.mode=disabled",
    ]


def _launch(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """`launchers/launch_finetune.py --config configs/demo.yaml ARGS` in this process (no signal handlers)."""
    from zerofit.recipe import run

    monkeypatch.setattr(run.StopSignal, "install", lambda self: self)
    return run.main(["--config", "configs/demo.yaml", *args])


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory (the lock aside) and its bytes."""
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".zerofit.lock"
    }


def test_an_early_stopped_run_resumed_is_finished_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _early_args(tmp_path)
    run_dir = tmp_path / "runs" / "early"
    assert _launch(monkeypatch, *args) == 0
    manifest = json.loads((run_dir / "checkpoints" / "step-3" / "manifest.json").read_text())
    assert manifest["early_stopped"] is True  # the stop state is part of the checkpoint
    # This process holds the run's lock until it exits: resume a copy, as another process would.
    run_dir = tmp_path / "requeued" / "early"
    shutil.copytree(tmp_path / "runs" / "early", run_dir, ignore=shutil.ignore_patterns(".zerofit.lock"))
    args.append(f"output_dir={run_dir.parent}")
    before = _files(run_dir)
    assert "adapter/adapter_model.safetensors" in before and "summary.json" in before
    capsys.readouterr()
    # A scheduler's requeue: exit 0, one paragraph, nothing trained or written.
    assert _launch(monkeypatch, *args, "checkpoint.resume=auto") == 0
    out, err = capsys.readouterr()
    assert out.count("has already finished") == 1 and not err
    assert "early stopping ended it after step 3" in out and "train.early_stopping.patience=N (N > 2" in out
    assert "resumed from" not in out
    assert _files(run_dir) == before
    # Asked to resume explicitly: the same paragraph as an error (exit 2), still nothing changed.
    assert _launch(monkeypatch, *args, "checkpoint.resume=true") == 2
    assert "has already finished: early stopping ended it" in capsys.readouterr().err
    assert _files(run_dir) == before
    # Killed between its last checkpoint and its final export: still finished, and told where the weights are.
    assert "was not written" not in out
    shutil.rmtree(run_dir / "adapter")
    assert _launch(monkeypatch, *args, "checkpoint.resume=auto") == 0
    out = capsys.readouterr().out
    assert "final export (adapter/) was not written after step-3" in out
    assert f"zerofit export {run_dir} --out DIR" in out


@pytest.mark.slow
def test_a_signal_in_the_step_that_ends_the_patience_ends_the_run_as_an_early_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    from zerofit.api import _config
    from zerofit.loop.evaluate import Evaluator
    from zerofit.recipe.run import resolve_for_launch, run_training
    from zerofit.strategies.env import launch_env

    stop = StopSignal()
    evaluate = Evaluator.after_step

    def sigterm_in_step_3(self: Evaluator, steps_done: int) -> dict[str, Any]:
        if steps_done == 3:  # the SIGTERM arrives while step 3, the one that runs the patience out, trains
            stop.signum = signal.SIGTERM
        return evaluate(self, steps_done)

    monkeypatch.setattr(Evaluator, "after_step", sigterm_in_step_3)
    items = dict(arg.split("=", 1) for arg in _early_args(tmp_path))
    cfg, _ = _config("configs/demo.yaml", {k: yaml.safe_load(v) for k, v in items.items()})
    outcome = run_training(resolve_for_launch(cfg, launch_env()), None, stop)
    run_dir = tmp_path / "runs" / "early"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (outcome.exit_code, summary["stop_reason"], summary["last_step"]) == (0, "early_stopping", 3)
    assert (run_dir / "adapter").is_dir()  # finished: exported, nothing left to resume
    manifest = json.loads((run_dir / "checkpoints" / "step-3" / "manifest.json").read_text())
    assert manifest["early_stopped"] is True


def test_a_finished_epochs_run_names_train_epochs_as_the_way_to_train_further(tmp_path: Path) -> None:
    from zerofit.checkpoint.resume import find_resume_point
    from zerofit.core.errors import ResumeError, RunFinished

    where = (f"output_dir={tmp_path}", "run_name=r")
    _, strategy = _two_epoch_run_saved_at(374, where)
    fmt = strategy.checkpoint_format
    with pytest.raises(ResumeError) as err:
        find_resume_point(_resolve("train.epochs=2", "checkpoint.resume=true", *where), fmt)
    text = str(err.value)
    assert "has already finished: it has trained all its train.epochs 2 = 374 steps" in text
    assert "train.epochs=N (N > 2) checkpoint.allow_changes=[train.epochs]" in text
    assert "train.max_steps" not in text  # refused for an epochs run: never suggested
    with pytest.raises(RunFinished):  # a requeue: the launcher exits 0
        find_resume_point(_resolve("train.epochs=2", "checkpoint.resume=auto", *where), fmt)
    # What the paragraph suggests is accepted.
    more = _resolve(
        "train.epochs=3", "checkpoint.allow_changes=[train.epochs]", "checkpoint.resume=true", *where
    )
    point = find_resume_point(more, fmt)
    assert point is not None and point.step == 374
