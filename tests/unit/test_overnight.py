"""Overnight defaults in one process: train.epochs (the exact step count, one config-level rule), the
wall-clock save interval agreed through the loop's one all-reduce, the best checkpoint kept beyond
keep_last, early stopping on eval/loss, distributed.timeout_minutes in the engine spec, and one real
tiny-llama run that stops early, keeps and exports its best checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from config_helpers import DEMO_DATA, one_process_strategy, prepared_one_process_strategy
from zerofit.checkpoint import Checkpointer, complete_checkpoints
from zerofit.checkpoint.policy import EvalWatch, SaveClock, Verdict, read_best, resolve_step
from zerofit.config import load_config, resolve
from zerofit.config.schema import CheckpointSection
from zerofit.data import GlobalBatchSampler
from zerofit.engine import render_spec
from zerofit.errors import ConfigError
from zerofit.run_plan import DataFacts, make_run_plan
from zerofit.signals import StopSignal
from zerofit.train import LoopInputs, agree_after_step


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


def test_an_epochs_run_resumes_on_its_epochs_and_data_not_on_the_derived_step_count(tmp_path: Path) -> None:
    from zerofit.checkpoint import checkpoint_record
    from zerofit.checkpoint.resume import find_resume_point
    from zerofit.errors import ResumeError

    where = (f"output_dir={tmp_path}", "run_name=r")
    launch = _resolve("train.epochs=2", *where)
    per_epoch = GlobalBatchSampler(3000, 16, seed=42).steps_per_epoch
    saved = make_run_plan(launch, render_spec(launch), data=DataFacts("prompt_response", per_epoch))
    strategy = prepared_one_process_strategy()
    record = checkpoint_record(saved, strategy.checkpoint_format)
    assert record["config"]["train"]["max_steps"] == 2 * 187
    Checkpointer(strategy, launch.run_dir, CheckpointSection(), max_steps=374, record=record).save(5)
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
    assert (watch.best_step, watch.best_loss, watch.stopped_at) == (4, 2.3, 6)
    assert "stopped after step 6" in watch.stop_line()
    resumed = EvalWatch(patience=2, min_delta=0.1)  # a resume replays the kept rows: same best, same count
    resumed.replay([{"step": 1, "loss": 9.0}, {"step": 2, "eval/loss": 3.0}, {"step": 4, "eval/loss": 2.95}])
    assert (resumed.best_step, resumed.since_best) == (2, 1) and resumed.judge(2.95).exhausted


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
