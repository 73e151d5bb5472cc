"""`rl.rewards` -> reward functions at launch (`zerofit.recipe.rewards.build_rewards`): built-ins by name, the
user's `module:function` imported, every bad name or setting refused in one paragraph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zerofit.config.schema import RewardSpec
from zerofit.core.errors import ConfigError
from zerofit.models.tiny import build_tokenizer
from zerofit.objectives.grpo import describe_reward
from zerofit.recipe.rewards import build_rewards, reward_spec_problems


def test_builtins_and_a_user_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards_ok.py").write_text(
        "def shout(prompts, completions, columns):\n    return [float(c.isupper()) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = [
        RewardSpec(function="exact_match"),
        RewardSpec(function="format_regex", pattern=r"\d+", weight=0.5),
        RewardSpec(function="format_regex", pattern=r"[A-Z]+"),
        RewardSpec(function="length", target_length=2),
        RewardSpec(function="my_rewards_ok:shout", weight=2.0),
    ]
    rewards = build_rewards(specs, build_tokenizer())
    assert [r.name for r in rewards] == [
        "exact_match",
        "format_regex",
        "format_regex_2",
        "length",
        "my_rewards_ok:shout",
    ]
    assert [r.weight for r in rewards] == [1.0, 0.5, 1.0, 1.0, 2.0]
    completions = ["12", "AB"]
    scores = [r.fn(["p", "p"], completions, {"answer": ["12", "3"]}) for r in rewards]
    assert scores == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]]
    sys.modules.pop("my_rewards_ok", None)


def test_unknown_names_and_missing_settings_are_one_paragraph_listing_the_forms() -> None:
    specs = [
        RewardSpec(function="exactmatch"),
        RewardSpec(function="format_regex"),
        RewardSpec(function="format_regex", pattern="("),
        RewardSpec(function="length"),
        RewardSpec(function="reward_model"),
    ]
    problems = reward_spec_problems(specs)
    assert len(problems) == 5
    assert "rl.rewards[0].function = 'exactmatch' is not a reward zerofit knows" in problems[0]
    assert (
        "exact_match, format_regex, length, reward_model" in problems[0] and "module:function" in problems[0]
    )
    assert "needs rl.rewards[1].pattern" in problems[1]
    assert "rl.rewards[2].pattern = '(' is not a regular expression" in problems[2]
    assert "needs rl.rewards[3].target_length" in problems[3] and "needs rl.rewards[4].path" in problems[4]
    with pytest.raises(ConfigError, match="5 problems"):
        build_rewards(specs, build_tokenizer())
    with pytest.raises(ConfigError, match=r"needs at least one reward in rl\.rewards"):
        build_rewards([], build_tokenizer())


def test_a_module_function_that_does_not_import_is_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_rewards_broken.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "my_rewards_empty.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "no_such_module_zf:f": "no module 'no_such_module_zf' can be imported; put no_such_module_zf.py on PYTHONPATH",
        "my_rewards_broken:f": "importing module 'my_rewards_broken' raised RuntimeError: boom",
        "my_rewards_empty:f": "module 'my_rewards_empty' has no function 'f'",
        "my_rewards_empty:X": "module 'my_rewards_empty' has no function 'X'",
    }
    for name, expected in cases.items():
        with pytest.raises(ConfigError, match=expected):
            build_rewards([RewardSpec(function=name)], build_tokenizer())
    for name in ("my_rewards_broken", "my_rewards_empty"):
        sys.modules.pop(name, None)


def test_describe_reward_names_the_module_without_importing_it() -> None:
    spec = RewardSpec(function="never_imported_zf.sub:score", weight=0.5)
    assert (
        describe_reward(spec)
        == "never_imported_zf.sub:score (imported at launch from module never_imported_zf.sub) x 0.5"
    )
    assert "never_imported_zf" not in sys.modules
    assert describe_reward(RewardSpec(function="exact_match")) == "exact_match (column answer) x 1"
