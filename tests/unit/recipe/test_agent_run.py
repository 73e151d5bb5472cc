"""Agentic GRPO end to end in this process on the built-in tiny model: a toy environment (`rl.environment:
module:Class`, imported from the user's config) answers each turn, its reward is the run's, and the reward
rises in a CI-sized run; a run folder's config names the environment and tools without anything importing
them afterwards; an environment that raises stops the run with one paragraph, exit code 2 (at launch, where
every record's first prompt is reset and rendered, or at the step where it raised); RLOO trains with tools."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

MODULE = "zerofit_planted_toy_env"  # a user environment module, only importable from tmp_path
STEPS = 20
ENVIRONMENT = '''
class Digits:
    """Two turns: each scored by the share of digits in it (half the reward each); the second is asked for."""

    def reset(self, row, seed):
        self.turns = 0
        return []

    def step(self, text):
        self.turns += 1
        share = sum(ch.isdigit() for ch in text) / max(len(text), 1)
        done = self.turns >= 2
        return ([] if done else [{"role": "user", "content": "more"}]), share / 2, done
'''


def _args(tmp_path: Path) -> list[str]:
    return [
        f"output_dir={tmp_path / 'runs'}",
        "run_name=env",
        "distributed.strategy=single",
        "distributed.preset=null",
        "train.objective=grpo",
        f"train.max_steps={STEPS}",
        "train.precision=fp32",
        "lora.enabled=false",
        "batch.global_batch_size=null",
        "batch.micro_batch_size=8",
        "rl.num_generations=8",
        "rl.prompts_per_step=2",
        "rl.max_completion_length=16",
        "rl.max_turns=2",
        f"rl.environment={MODULE}:Digits",
        "rl.log_completions_every=5",
        "scheduler.name=constant",
        "scheduler.warmup_steps=0",
        f"data.path={tmp_path / 'prompts.jsonl'}",
        "data.eval_split=null",
        "data.eval_path=null",
        "checkpoint.every_steps=0",
        "logging.console=false",
        "logging.wandb.mode=disabled",
    ]


def test_the_reward_of_a_toy_environment_rises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerofit.recipe import run

    (tmp_path / f"{MODULE}.py").write_text(ENVIRONMENT)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(run.StopSignal, "install", lambda self: self)
    try:
        assert run.main(["--config", "configs/demo.yaml", *_args(tmp_path)]) == 0
    finally:
        sys.modules.pop(MODULE, None)
    run_dir = tmp_path / "runs" / "env"
    rows: list[dict[str, Any]] = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    first, last = (sum(r["reward"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last > 2 * first and last > first + 0.1, [r["reward"] for r in rows]  # measured 0.06 -> 0.25
    assert all(r["rewards/environment"] == r["reward"] for r in rows)  # the environment's reward is the run's
    # a first turn that ends within the budget gets the environment's `more` (masked) and a second turn
    assert any(r["agent/turns"] > 1 and r["agent/masked_tokens"] > 0 for r in rows), rows
    shown = json.loads((run_dir / "completions.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in shown["messages"]][:2] == ["user", "assistant"]
    assert json.loads((run_dir / "run_info.json").read_text())["rl"]["environment"] == f"{MODULE}:Digits"
    _export_imports_nothing(run_dir, tmp_path)


def _export_imports_nothing(run_dir: Path, tmp_path: Path) -> None:
    """The run folder's config names the environment; exporting that folder must not import it."""
    from zerofit.cli import main

    assert MODULE in (run_dir / "config.yaml").read_text() and MODULE not in sys.modules
    assert main(["export", str(run_dir), "--out", str(tmp_path / "exported")]) == 0
    assert MODULE not in sys.modules


BROKEN = """
class Broken:
    def reset(self, row, seed):
        if {in_reset}:
            raise ValueError("no board for this row")
        return []

    def step(self, text):
        raise KeyError("move")
"""


@pytest.mark.parametrize("in_reset", [True, False])
def test_an_environment_that_raises_stops_the_run_with_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], in_reset: bool
) -> None:
    """Its reset raises: refused at launch (every record's first prompt is reset and rendered then), before
    the run folder's files; its step raises: the run stops at step 1 with the paragraph and what was kept."""
    from zerofit.recipe import run

    (tmp_path / f"{MODULE}.py").write_text(BROKEN.format(in_reset=in_reset))
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(run.StopSignal, "install", lambda self: self)
    args = [*_args(tmp_path), f"rl.environment={MODULE}:Broken", "train.max_steps=2", "logging.console=true"]
    capsys.readouterr()
    try:
        assert run.main(["--config", "configs/demo.yaml", *args]) == 2
    finally:
        sys.modules.pop(MODULE, None)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err.count(f"The environment {MODULE}:Broken failed") == 1, err
    if in_reset:
        assert "failed in reset() on data record 1 (checked at launch): it raised ValueError: no board" in err
        assert not (tmp_path / "runs" / "env" / "metrics.jsonl").exists()
    else:
        assert "failed in step() on the rollout of step 1, data record " in err
        assert ", turn 1: it raised KeyError: 'move'; an environment is your code" in err
        assert "No checkpoint was saved yet (nothing of step 1 was)" in err


def test_rloo_trains_with_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`train.objective: rloo` with `rl.tools` (the tiny model taught to call them, `agent_helpers`), LoRA and
    rl.beta > 0: the trajectories call tools over several turns, every step updates the adapters, and RLOO's
    KL penalty counts only the sampled tokens (`trained_mask`): 0 at step 1, where the zero-initialised
    adapters leave the policy equal to its reference."""
    from agent_helpers import TOOLS, problems, tool_caller
    from zerofit.recipe import run

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in problems(8, seed=1)))
    monkeypatch.setattr(run.StopSignal, "install", lambda self: self)
    args = [
        *_args(tmp_path),
        f"model.name_or_path={tool_caller()}",
        "rl.environment=null",
        "train.objective=rloo",
        "train.max_steps=2",
        "lora.enabled=true",
        "rl.beta=0.05",
        "rl.num_generations=4",
        "rl.max_completion_length=160",
        "rl.max_turns=3",
        "rl.temperature=1.5",
        f"rl.tools={json.dumps(TOOLS)}",
        "rl.rewards=[{function: exact_match, column: answer}, {function: length, target_length: 64}]",
        "batch.micro_batch_size=4",
    ]
    assert run.main(["--config", "configs/demo.yaml", *args]) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "runs" / "env" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 2
    assert all(
        r["agent/tool_calls"] > 0 and r["agent/turns"] > 1 and r["agent/masked_tokens"] > 0 for r in rows
    )
    assert all(r["grad_norm"] > 0 for r in rows), rows
    assert rows[0]["kl"] == 0.0 and all(abs(r["kl"]) < 1.0 for r in rows), [r["kl"] for r in rows]
