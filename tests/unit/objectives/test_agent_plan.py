"""The plan of an agentic GRPO run (`zerofit.objectives.grpo`): its tools, environment, turn limit and token
budget said without importing anything; a budget that cannot hold its turns refused with the keys to change;
an environment may stand in for the reward functions."""

from __future__ import annotations

import sys

import pytest

from config_helpers import REPO
from zerofit.config import load_config
from zerofit.core.errors import ConfigError
from zerofit.objectives.grpo import GRPO
from zerofit.resolution import resolve

AGENT = (
    "train.objective=grpo",
    "batch.global_batch_size=null",
    "rl.num_generations=4",
    "rl.prompts_per_step=2",
    "rl.tools=[{function: calculator}, {function: zerofit_never_imported_tools:weather}]",
    "rl.environment=zerofit_never_imported_env:Game",
)


def _resolve(*overrides: str):  # -> ResolvedConfig
    return resolve(load_config(REPO / "configs" / "demo.yaml", [*AGENT, *overrides]), 1)


def test_the_plan_counts_a_multi_turn_trajectory_and_imports_nothing() -> None:
    resolved = _resolve("rl.max_turns=3", "rl.max_completion_length=96", "rl.max_prompt_length=200")
    text = GRPO.describe(resolved.config, "none") or ""
    assert "multi-turn: tools calculator, zerofit_never_imported_tools:weather" in text
    assert "environment zerofit_never_imported_env:Game (imported at launch)" in text
    assert "<= 3 assistant turns per trajectory" in text and "planned at 200 + 96 tokens" in text
    assert GRPO.max_tokens_per_unit(resolved.config)[0] == 296  # what the memory plan and the KV cache count
    assert (
        "zerofit_never_imported_env" not in sys.modules and "zerofit_never_imported_tools" not in sys.modules
    )


def test_a_budget_too_small_for_its_turns_is_refused_with_the_keys() -> None:
    with pytest.raises(ConfigError) as err:
        _resolve("rl.max_turns=4", "rl.max_completion_length=16")
    text = str(err.value)
    assert "rl.max_turns = 4 with rl.max_completion_length = 16" in text
    assert "raise rl.max_completion_length to at least 32 or lower rl.max_turns" in text
    assert "rl.rewards is empty" not in text  # the environment gives the rewards


ENV_REWARD = (
    "environment (what zerofit_never_imported_env:Game's step returns, summed over the trajectory's turns; "
    "imported at launch) x 1"
)


def test_the_plan_names_the_environment_as_a_source_of_rewards() -> None:
    """Without rl.rewards the environment is where the rewards come from (not an empty list, `rewards: ;`);
    with reward functions, it follows them."""
    from zerofit.objectives.rloo import RLOO

    alone = GRPO.describe(_resolve().config, "none") or ""
    assert f"rewards: {ENV_REWARD}; multi-turn:" in alone and "rewards: ;" not in alone
    both = _resolve("rl.rewards=[{function: exact_match}]").config
    assert f"rewards: exact_match (column answer) x 1; {ENV_REWARD}; multi-turn:" in (
        GRPO.describe(both, "") or ""
    )
    assert (RLOO.describe(both, "") or "").endswith(f"rewards: exact_match (column answer) x 1; {ENV_REWARD}")
    assert "zerofit_never_imported_env" not in sys.modules


def test_zerofit_plan_prints_the_environments_reward(capsys: pytest.CaptureFixture[str]) -> None:
    """`zerofit plan`'s reward lines name the environment, not "none (a launch refuses ...)"."""
    from zerofit.cli import main

    assert main(["plan", "--config", str(REPO / "configs" / "demo.yaml"), *AGENT]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"Reward: {ENV_REWARD}" in out and "Reward: none" not in out, out
    assert "zerofit_never_imported_env" not in sys.modules
