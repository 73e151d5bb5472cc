"""`rl.rewards` -> the run's reward functions (`zerofit.objectives.grpo.rewards.NamedReward`), built at launch.

A built-in is named by itself (`objectives.rewards.BUILTIN_REWARDS`); the user's own function as
`module:function`, imported with importlib. Only a launch does this, from the config the user launched
with: a run folder's saved config.yaml is data, so `zerofit export`, `zerofit generate`, `zerofit plan` and
`zerofit compare` of any run folder never call `build_rewards` and import nothing it names
(`zerofit.objectives.grpo.describe_reward` says what a launch would import, without importing it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerofit.config.schema import RewardSpec
from zerofit.core.errors import ConfigError
from zerofit.objectives.grpo.rewards import (
    NamedReward,
    RewardFn,
    exact_match,
    format_regex,
    known_rewards,
    length,
    reward_spec_problems,
)
from zerofit.recipe.user_code import import_user_object

__all__ = ["build_rewards", "reward_spec_problems"]  # the last re-exported from objectives


def _import_function(i: int, name: str) -> RewardFn:
    """The user's `module:function`, imported now (a launch, from the user's own config)."""
    return import_user_object(f"rl.rewards[{i}].function = {name!r}", name)


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


def _build_one(i: int, spec: RewardSpec, tokenizer: Any) -> RewardFn:
    if spec.function == "exact_match":
        return exact_match(spec.column)
    if spec.function == "format_regex":
        return format_regex(str(spec.pattern))
    if spec.function == "length":
        return length(int(spec.target_length or 0), _token_counter(tokenizer))
    if spec.function == "reward_model":
        from zerofit.models.reward_model import reward_model  # loads torch weights: only when asked

        return reward_model(str(spec.path))
    return _import_function(i, spec.function)


def _unique_names(specs: list[RewardSpec]) -> list[str]:
    """Each reward's name in metrics and errors: its function, `_2`, `_3` ... on a repeat."""
    seen: dict[str, int] = {}
    names = []
    for spec in specs:
        seen[spec.function] = seen.get(spec.function, 0) + 1
        names.append(spec.function if seen[spec.function] == 1 else f"{spec.function}_{seen[spec.function]}")
    return names


def build_rewards(specs: list[RewardSpec], tokenizer: Any, required: bool = True) -> list[NamedReward]:
    """The run's reward functions, in `rl.rewards` order. ConfigError (one paragraph, every problem) for an
    unknown name, a missing setting, or a `module:function` that does not import; only a launch calls this.
    `required`: none is an error (an `rl.environment` gives rewards of its own)."""
    problems = reward_spec_problems(specs)
    if not specs and required:
        problems.append(f"train.objective grpo needs at least one reward in rl.rewards: {known_rewards()}")
    if problems:
        raise ConfigError(problems)
    names = _unique_names(specs)
    return [
        NamedReward(name=name, weight=spec.weight, fn=_build_one(i, spec, tokenizer))
        for i, (name, spec) in enumerate(zip(names, specs, strict=True))
    ]
