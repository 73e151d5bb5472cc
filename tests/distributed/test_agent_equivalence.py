"""Agentic GRPO (multi-turn rollouts with two tools, at most 3 turns), any split, any engine: one curve.

The tiny Llama taught to call tools (`agent_helpers.tool_caller`: a compact template with a tools section,
Hermes `<tool_call>` calls; sampled at temperature 1.5 it writes valid calls, malformed ones and plain answers), fp32,
full fine-tuning, 2 prompts x G 4 = 8 trajectories per step of at most 3 turns and 160 tokens, the built-in
calculator and lookup tools, exact_match and length (for rewards that differ within a group) on the final
turn, 3 steps; the one-process references through the
Python API (`zerofit.train`, in the test process), the interrupted ZeRO-2 run through torchrun (gloo), the
rest `warm` (tests/warm_launch.py):

    launch          launcher   engine              split (micro x accum x dp)   what
    single          api        one process         8 x 1 x 1                   the reference curve
    single-2x4      api        one process         2 x 4 x 1                   another split, one process
    zero2           torchrun   DeepSpeed ZeRO-2    2 x 2 x 2                   SIGTERM mid-run, then resumed
    zero2-resumed   warm       DeepSpeed ZeRO-2    2 x 2 x 2                   zero2 resumed
    fsdp            warm       FSDP2               1 x 4 x 2                   layers gathered once per rollout

Each turn of each trajectory samples from its own generator seeded by (seed, step, completion index, turn),
and the tools see only their trajectory's row and text, so every split samples the same tokens: the loss,
grad norm, reward and the multi-turn counts agree within 1e-5, and the resumed run continues the curve.
"""

from __future__ import annotations

import json
import signal

import pytest

from agent_helpers import TOOLS, problems, tool_caller
from launch_helpers import Launch, RunResult, max_difference, metric_rows, run_launches, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, TOL = 3, 1e-5
CURVES = (
    "loss",
    "grad_norm",
    "reward",
    "entropy",
    "completions/mean_length",
    "agent/turns",
    "agent/tool_calls",
    "agent/tool_errors",
    "agent/sampled_tokens",
    "agent/masked_tokens",
    "agent/truncated_fraction",
)
Z2 = ("distributed.strategy=deepspeed", "distributed.preset=zero2", "batch.micro_batch_size=2")
LAUNCHES = [
    Launch("single", "api", ("distributed.strategy=single", "batch.micro_batch_size=8")),
    Launch("single-2x4", "api", ("distributed.strategy=single", "batch.micro_batch_size=2")),
    Launch("zero2", "torchrun", Z2, interrupt=(signal.SIGTERM, "group", 1)),
    Launch("fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
]
RESUMED = Launch("zero2", "warm", (*Z2, "checkpoint.resume=true"), key="zero2-resumed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("agent")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in problems(16, seed=1)))
    config = write_config(
        root / "agent.yaml",
        {
            "seed": 5,
            "model": {"name_or_path": str(tool_caller())},
            "train": {"objective": "grpo", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": 1e-3},
            "scheduler": {"name": "constant"},
            "lora": {"enabled": False},
            "rl": {
                "num_generations": 4,
                "prompts_per_step": 2,
                "max_prompt_length": 64,
                "max_completion_length": 160,
                "max_turns": 3,
                "temperature": 1.5,
                "tools": TOOLS,
                "rewards": [
                    {"function": "exact_match", "column": "answer"},
                    {"function": "length", "target_length": 64, "weight": 0.5},
                ],
                "log_completions_every": 1,
            },
            "data": {"path": str(prompts)},
            "checkpoint": {"every_minutes": 0},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    results = run_launches(LAUNCHES, config, root / "runs")
    results.update(run_launches([RESUMED], config, root / "runs"))
    for key, result in results.items():
        if key != "zero2":  # the interrupted segment ends by its signal
            result.check()
    return results


@pytest.mark.parametrize("name", ["single-2x4", "zero2-resumed", "fsdp"])
def test_one_agent_curve_for_every_engine_and_split(runs: dict[str, RunResult], name: str) -> None:
    run, base = runs[name], runs["single"]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    a, b = metric_rows(run, CURVES), metric_rows(base, CURVES)
    worst = max_difference(a, b)
    assert worst < TOL, (a, b)
    assert run.series("tokens") == base.series("tokens")


def test_the_trajectories_call_tools_over_several_turns(runs: dict[str, RunResult]) -> None:
    """The curve compared is of real multi-turn work: calls, replies (masked tokens) and several turns."""
    rows = runs["single"].metrics
    assert all(r["agent/turns"] > 1 and r["agent/tool_calls"] > 0 for r in rows), rows
    assert all(r["agent/masked_tokens"] > 0 and r["agent/sampled_tokens"] > 0 for r in rows)
    assert all(abs(r["grad_norm"]) > 0 for r in rows)  # real updates: the rewards differ within groups


def test_resume_after_sigterm_and_whole_conversations_in_completions(runs: dict[str, RunResult]) -> None:
    stopped, resumed = runs["zero2"], runs["zero2-resumed"]
    assert "resume with the same command plus checkpoint.resume=true" in stopped.stdout
    assert "resumed from" in resumed.stdout
    lines = (runs["fsdp"].run_dir / "completions.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    roles = [m["role"] for m in first["messages"]]
    assert (
        roles[0] == "user"
        and "assistant" in roles
        and first["completion"] == first["messages"][-1]["content"]
    )
    assert any(m["role"] == "tool" for line in lines for m in json.loads(line)["messages"])
