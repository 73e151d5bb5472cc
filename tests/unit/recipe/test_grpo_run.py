"""A GRPO run end to end in this process, on the built-in tiny model: SIGTERM during a step's generation saves
at the step boundary and the resumed run reproduces the uninterrupted one (sampling seeds and data order
included); export and generate of the run folder import nothing its config names; the rl rules refuse."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from config_helpers import REPO
from zerofit.config import load_config
from zerofit.core.errors import ConfigError
from zerofit.resolution import resolve

pytestmark = pytest.mark.slow

MODULE = "zerofit_planted_toy_rewards"  # a user reward module, only importable from tmp_path
FIELDS = ("loss", "grad_norm", "reward", "reward_std", "kl", "completions/mean_length")


def _write_task(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"item {i}: ", "answer": str(i)}) for i in range(12)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / f"{MODULE}.py").write_text(
        "def digits(prompts, completions, columns):\n"
        "    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n"
    )


def _args(tmp_path: Path, output: str) -> list[str]:
    return [
        f"output_dir={tmp_path / output}",
        "run_name=grpo",
        "distributed.strategy=single",
        "distributed.preset=null",
        "train.objective=grpo",
        "train.max_steps=4",
        "train.precision=fp32",
        "batch.global_batch_size=null",
        "batch.micro_batch_size=4",
        "rl.num_generations=4",
        "rl.prompts_per_step=2",
        "rl.max_completion_length=4",
        "rl.num_iterations=2",
        f"rl.rewards=[{{function: '{MODULE}:digits'}}]",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        "data.eval_split=null",
        "data.eval_path=null",
        "checkpoint.every_steps=0",
        "logging.console=false",
        "logging.wandb.mode=disabled",
    ]


def _launch(monkeypatch: pytest.MonkeyPatch, args: list[str], stop_at: int | None = None) -> int:
    """launch_finetune.py with configs/demo.yaml in this process; `stop_at`: a SIGTERM arrives during that
    (0-based) step's generation."""
    from zerofit.loop import rollout
    from zerofit.recipe import run

    stops: list[Any] = []
    monkeypatch.setattr(run.StopSignal, "install", lambda self: stops.append(self) or self)
    original = rollout.Rollouts.step_batches

    def step_batches(self: Any, strategy: Any, model: Any, step: int) -> Any:
        if step == stop_at:
            stops[0].signum = signal.SIGTERM  # what the handler records, mid-generation of this step
        return original(self, strategy, model, step)

    monkeypatch.setattr(rollout.Rollouts, "step_batches", step_batches)
    return run.main(["--config", "configs/demo.yaml", *args])


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_mid_generation_then_resume_is_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_task(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # The uninterrupted run also logs its sampled completions every 2 steps, to the file and to W&B.
    logged = ["rl.log_completions_every=2", "logging.wandb.mode=offline"]
    assert _launch(monkeypatch, [*_args(tmp_path, "whole"), *logged]) == 0
    whole = _rows(tmp_path / "whole" / "grpo")
    _ends_on_the_reward(tmp_path / "whole" / "grpo", whole, capsys.readouterr().out)
    _completions_reach_the_file_and_wandb(tmp_path / "whole" / "grpo")
    assert _launch(monkeypatch, _args(tmp_path, "cut"), stop_at=1) == 128 + signal.SIGTERM
    cut = tmp_path / "cut" / "grpo"
    assert [r["step"] for r in _rows(cut)] == [1, 2]
    assert (cut / "checkpoints" / "step-2").is_dir()
    # This process holds the run's lock until it exits: resume a copy, as another process would.
    shutil.copytree(cut, tmp_path / "resumed" / "grpo", ignore=shutil.ignore_patterns(".zerofit.lock"))
    assert _launch(monkeypatch, [*_args(tmp_path, "resumed"), "checkpoint.resume=true"]) == 0
    resumed = _rows(tmp_path / "resumed" / "grpo")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed, strict=True):
        for key in FIELDS:
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)
    _ends_on_the_reward(tmp_path / "resumed" / "grpo", whole, capsys.readouterr().out)  # the whole run's
    _export_and_generate_import_nothing(tmp_path / "whole" / "grpo", tmp_path, monkeypatch)


def _ends_on_the_reward(run_dir: Path, rows: list[dict[str, Any]], out: str) -> None:
    """A GRPO run is judged by its reward ("watch reward, not loss"): the closing line and summary.json say
    where the mean reward went (first and last 2 of 4 steps), not the loss."""
    first, last = (sum(r["reward"] for r in part) / 2 for part in (rows[:2], rows[2:]))
    closing = f"done: 4 steps, reward {first:.4f} -> {last:.4f} (mean of the first / last 2 steps)"
    assert closing in out.splitlines(), out[-2000:]
    judged = json.loads((run_dir / "summary.json").read_text())["judged_by"]
    assert list(judged) == ["reward"] and judged["reward"]["steps"] == 2
    assert (judged["reward"]["first"], judged["reward"]["last"]) == pytest.approx((first, last), abs=1e-6)


def _completions_reach_the_file_and_wandb(run_dir: Path) -> None:
    """At steps 2 and 4, a few sampled completions (step, prompt, completion, reward and each reward
    function's score) went to completions.jsonl, and the same rows to W&B as the `completions` table."""
    from zerofit.loop.rollout import COMPLETIONS_FILE, COMPLETIONS_TABLE
    from zerofit.metrics.wandb_reader import find_run_file, read_table, read_wandb_run

    rows = [json.loads(line) for line in (run_dir / COMPLETIONS_FILE).read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [2, 4] and len(rows) == 8
    key = f"rewards/{MODULE}:digits"
    assert set(rows[0]) == {"step", "prompt", "completion", "reward", key}
    assert all(r["reward"] == pytest.approx(r[key]) for r in rows)  # one function, weight 1
    run = read_wandb_run(find_run_file(run_dir))
    for step in (2, 4):
        assert read_table(run, COMPLETIONS_TABLE, step) == [r for r in rows if r["step"] == step]
        assert run.history[step]["reward"] == pytest.approx(_rows(run_dir)[step - 1]["reward"])


def _export_and_generate_import_nothing(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run folder's config.yaml names the user's reward module; export and generate of that folder must
    not import it (files from elsewhere are data)."""
    from zerofit.cli import main

    assert MODULE in (run_dir / "config.yaml").read_text()
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "exported")]) == 0
    assert main(["generate", str(run_dir), "--prompt", "item 1: ", "--max-new-tokens", "2"]) == 0
    assert MODULE not in sys.modules


def test_the_held_out_reward_is_logged_and_the_best_checkpoint_follows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.eval_split with GRPO (refused before): after every step the policy answers the 3 held-out prompts
    (seeded: the same seeds each time) and the digits reward scores them; `eval/reward` and the function's
    own mean are in every row, and the best checkpoint, best.json, summary.json and the closing line follow
    the highest eval/reward (not a loss: GRPO has no held-out labels)."""
    _write_task(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [*_args(tmp_path, "held"), "data.eval_split=0.25", "eval.every_steps=1", "checkpoint.keep_last=1"]
    args += ["optimizer.lr=0.1", "rl.num_iterations=1"]
    assert _launch(monkeypatch, args) == 0
    run_dir = tmp_path / "held" / "grpo"
    rows, out = _rows(run_dir), capsys.readouterr().out
    assert "3 prompts (0.25 of" in out and "eval/reward (seeded answers) every 1 steps" in out
    rewards = [r["eval/reward"] for r in rows]
    assert len(rewards) == 4 and all(r["eval/prompts"] == 3 for r in rows)
    assert all(r["eval/reward"] == r[f"eval/rewards/{MODULE}:digits"] for r in rows)  # one function, weight 1
    best = rewards.index(max(rewards)) + 1  # the first of the highest (a tie is no improvement)
    assert best != rewards.index(min(rewards)) + 1, rewards  # lr 0.1 moves it: "lowest" would pick another
    record = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert (record["metric"], record["step"], record["value"]) == ("eval/reward", best, max(rewards))
    assert (run_dir / "checkpoints" / f"step-{best}").is_dir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["best_step"], summary["best_eval_reward"]) == (best, max(rewards))
    assert f"best: eval/reward {max(rewards):.4f} at step {best}" in out


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(load_config(REPO / "configs" / "demo.yaml", ["train.objective=grpo", *overrides]), 1)
    return str(err.value)


def test_the_rl_rules_refuse_with_the_keys() -> None:
    text = _problems("rl.num_generations=4", "rl.prompts_per_step=2", "batch.global_batch_size=6")
    assert "batch.global_batch_size = 6" in text and "4 x 2 = 8 completions" in text
    assert "rl.rewards is empty" in text
    text = _problems(
        "rl.generation_backend=vllm",
        "distributed.strategy=deepspeed",
        "distributed.preset=zero3",
        "rl.rewards=[{function: length, target_length: 3}]",
    )
    assert "rl.generation_backend = 'vllm'" in text and "'zero3' is ZeRO-3" in text
    text = _problems(
        "rl.num_generations=4",
        "rl.prompts_per_step=2",
        "batch.global_batch_size=null",
        "batch.micro_batch_size=3",
        "rl.rewards=[{function: length, target_length: 3}]",
    )
    assert "rl.num_generations x rl.prompts_per_step = 4 x 2 completions" in text and "1, 2, 4, 8" in text


BAD = "zerofit_planted_bad_reward"


@pytest.mark.parametrize("fail_at", [3, 1])
def test_a_reward_failing_mid_run_is_one_paragraph_naming_the_checkpoint_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fail_at: int
) -> None:
    """The user's reward returns a NaN at step `fail_at`: the run stops with the paragraph naming the function,
    the step and the row, exit code 2, and what was kept: at step 3 the step-2 checkpoint (nothing of step 3
    saved) and how to resume; at step 1 that no checkpoint was saved yet (it used to say the run "keeps its
    last checkpoint"), with no summary table of a run that trained nothing."""
    _write_task(tmp_path)
    (tmp_path / f"{BAD}.py").write_text(
        "CALLS = []\n"
        "def flaky(prompts, completions, columns):\n"
        "    CALLS.append(1)\n"
        f"    return [float('nan') if len(CALLS) == {fail_at} and i == 1 else 0.5 for i in range(len(completions))]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, BAD, raising=False)
    args = [
        *_args(tmp_path, "bad"),
        f"rl.rewards=[{{function: '{BAD}:flaky'}}]",
        "checkpoint.every_steps=1",
        "logging.console=true",
    ]
    capsys.readouterr()
    assert _launch(monkeypatch, args) == 2
    out, err = capsys.readouterr()
    assert f"The reward function '{BAD}:flaky' failed at step {fail_at} on data row" in err and "NaN" in err
    assert err.count(f"failed at step {fail_at}") == 1 and "Traceback" not in err
    run_dir = tmp_path / "bad" / "grpo"
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert "keeps its last checkpoint" not in err
    if fail_at == 3:
        assert saved == ["step-1", "step-2"]
        assert (
            f"The last good checkpoint, {run_dir / 'checkpoints' / 'step-2'} (step 2), is kept: nothing of step 3 "
            "was saved. Once fixed, resume from it with the same command plus checkpoint.resume=true"
        ) in err
        assert "zerofit: grpo summary" in out  # two steps trained
    else:
        assert saved == []
        assert "No checkpoint was saved yet (nothing of step 1 was): once fixed, start the run again" in err
        assert "summary" not in out and "wall time" not in out, out


def test_a_reward_that_cannot_be_imported_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `module:function` reward that cannot be imported is a config error said before the plan, the run's
    files and the metrics sinks (it used to follow the plan and an empty summary table, "wall time 0.0 s")."""
    _write_task(tmp_path)
    args = [
        *_args(tmp_path, "missing"),
        "rl.rewards=[{function: 'zerofit_planted_no_such_module:fn'}]",
        "logging.console=true",
    ]
    capsys.readouterr()
    assert _launch(monkeypatch, args) == 2
    out, err = capsys.readouterr()
    assert "rl.rewards[0].function = 'zerofit_planted_no_such_module:fn': no module" in err
    assert "Traceback" not in err
    assert "zerofit plan" not in out and "summary" not in out and "wall time" not in out, out
    assert not (tmp_path / "missing").exists()  # nothing written: no config.yaml, no metrics, no summary.json
