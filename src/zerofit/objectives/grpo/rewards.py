"""Reward functions of an online-RL run (`train.objective: grpo`) and the one place that calls them.

A reward function takes a step's prompts, their completions and the data's other columns (one list per
column, one entry per completion, so row i of every list belongs to completion i) and returns one float per
completion (TRL's reward-function signature, without its keyword splat):

    fn(prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float]

`score_completions` calls each function once per batch and sums the scores by weight, in float64. A function
that raises, returns another number of scores than completions, or a score that is not a finite number (NaN,
inf, None, a string) stops the run with one paragraph (`RewardError`) naming the function, the step and the
data row: a silent NaN would poison every advantage of its group.

Built-ins (each a factory taking its `rl.rewards` settings):

    exact_match(column)     1.0 when the completion's final answer equals the row's `column`, else 0.0
                            (`final_answer`, `answers_equal` below say the rules);
    format_regex(pattern)   1.0 when the whole completion, surrounding whitespace stripped, matches the
                            pattern (`re.fullmatch`, `.` spanning lines), else 0.0;
    length(target, count)   1 - |L - target| / target, floored at 0: 1.0 at `target` tokens (`count` counts
                            them with the run's tokenizer), 0.0 at none or twice the target.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import torch

from zerofit.core.errors import RewardError

__all__ = [
    "BUILTIN_REWARDS",
    "NamedReward",
    "RewardFn",
    "answers_equal",
    "exact_match",
    "final_answer",
    "format_regex",
    "is_finite_score",
    "known_rewards",
    "length",
    "reward_spec_problems",
    "score_completions",
]

RewardFn = Callable[[list[str], list[str], dict[str, list[Any]]], list[float]]

# The names `rl.rewards[].function` may give for a built-in; anything else must be `module:function`.
BUILTIN_REWARDS: tuple[str, ...] = ("exact_match", "format_regex", "length", "reward_model")


_IMPORT_FORM = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def known_rewards() -> str:
    """The forms `rl.rewards[].function` takes, in words (for the paragraphs that refuse another)."""
    return (
        f"the built-ins {', '.join(BUILTIN_REWARDS)}, or your own function as `module:function` (a module "
        "importable at launch, e.g. my_rewards:correct for my_rewards.py on PYTHONPATH, called with (prompts, "
        "completions, columns) and returning one float per completion)"
    )


def _spec_problem(i: int, spec: Any) -> str | None:
    """What is wrong with `rl.rewards[i]` that the config alone shows (nothing is imported or loaded)."""
    where = f"rl.rewards[{i}]"
    name = spec.function
    if name not in BUILTIN_REWARDS and not _IMPORT_FORM.match(name):
        return f"{where}.function = {name!r} is not a reward zerofit knows; use {known_rewards()}"
    needs = {"format_regex": "pattern", "length": "target_length", "reward_model": "path"}.get(name)
    if needs is not None and getattr(spec, needs) is None:
        return f"{where}: the {name} reward needs {where}.{needs}; set it"
    if name == "format_regex":
        try:
            re.compile(str(spec.pattern))
        except re.error as exc:
            return f"{where}.pattern = {spec.pattern!r} is not a regular expression ({exc}); fix it"
    return None


def reward_spec_problems(specs: Sequence[Any]) -> list[str]:
    """Every problem of `rl.rewards` (`RewardSpec`s) the config alone shows, one line each (empty when none):
    an unknown name, a built-in's missing setting, a pattern that does not compile. Nothing is imported."""
    return [p for i, spec in enumerate(specs) if (p := _spec_problem(i, spec)) is not None]


@dataclass(frozen=True)
class NamedReward:
    """One reward function of the run, the name its metrics and errors use, and its weight in the sum."""

    name: str
    weight: float
    fn: RewardFn


# A number as people write it: an optional sign, digits with optional thousands commas, an optional fraction.
# A sign counts only where it cannot be a minus between two terms ("3-2" holds 3 and 2, not -2).
_NUMBER = re.compile(r"(?:(?<![\w).])[-+])?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_BOXED = re.compile(r"\\boxed\{")
_HASHES = re.compile(r"####\s*(.*)")
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]\s*(.*)", re.IGNORECASE)


def _boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def _marked(text: str) -> str | None:
    """What a final-answer marker holds, by priority: the last `\\boxed{...}`, else the rest of the line
    after the last `####` (GSM8K), else after the last `answer:` / `answer is:` / `answer =`."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    for marker in (_HASHES, _ANSWER):
        found = list(marker.finditer(text))
        if found:
            return found[-1].group(1).strip()  # `.` stops at the line's end
    return None


def _number(text: str) -> Decimal | None:
    """`text` as a number when it is one ("1,000", "1000.0", "$1000", "1000." all 1000), else None."""
    cleaned = text.strip().strip("$").rstrip(".").strip()
    if not _NUMBER.fullmatch(cleaned):
        return None
    try:
        return Decimal(cleaned.replace(",", ""))
    except InvalidOperation:
        return None


def final_answer(text: str) -> str:
    """A completion's final answer: the content of its last `\\boxed{...}` as it is; else what the last
    `####` or `answer:` marker holds, else the whole text, reduced to its last number when it holds one
    ("answer: 42 apples" gives 42) and is not a number itself ("$1,000.00" stays whole)."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    marked = _marked(text)
    scope = (marked if marked is not None else text).strip()
    if _number(scope) is not None:
        return scope
    numbers = _NUMBER.findall(scope)
    return numbers[-1] if numbers else scope


def answers_equal(answer: str, reference: Any) -> bool:
    """Numerically equal when both are numbers ("1,000" == "1000" == "1000.0"), else equal as text
    (case-folded, inner whitespace collapsed, a trailing period dropped). A reference holding a marker (a
    GSM8K solution ending `#### 72`) is compared by its own final answer."""
    ref = str(reference)
    if _marked(ref) is not None:
        ref = final_answer(ref)
    a, b = _number(answer), _number(ref)
    if a is not None and b is not None:
        return a == b

    def text(s: str) -> str:
        return " ".join(s.strip().rstrip(".").casefold().split())

    return text(answer) == text(ref)


def exact_match(column: str) -> RewardFn:
    """1.0 when a completion's `final_answer` equals its row's `column` (`answers_equal`), else 0.0."""

    def reward(prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float]:
        if column not in columns:
            have = ", ".join(repr(c) for c in columns) or "none"
            raise KeyError(
                f"the data has no column {column!r} (its columns: {have}); set rl.rewards[].column to the "
                "column holding the reference answers"
            )
        refs = columns[column]
        return [float(answers_equal(final_answer(c), r)) for c, r in zip(completions, refs, strict=True)]

    return reward


def format_regex(pattern: str) -> RewardFn:
    """1.0 when the whole stripped completion matches `pattern` (`re.fullmatch`, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float]:
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return reward


def length(target_length: int, count_tokens: Callable[[str], int]) -> RewardFn:
    """max(0, 1 - |L - target| / target) for a completion of L tokens (`count_tokens`)."""

    def reward(prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float]:
        return [max(0.0, 1.0 - abs(count_tokens(c) - target_length) / target_length) for c in completions]

    return reward


def _call(
    reward: NamedReward, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
) -> Any:
    return reward.fn(list(prompts), list(completions), {k: list(v) for k, v in columns.items()})


def _first_failing_row(
    reward: NamedReward, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
) -> int | None:
    """The first completion the function raises on when called on it alone (None: only the batch fails)."""
    for i in range(len(completions)):
        try:
            _call(
                reward,
                prompts[i : i + 1],
                completions[i : i + 1],
                {k: v[i : i + 1] for k, v in columns.items()},
            )
        except Exception:
            return i
    return None


def _where(reward: NamedReward, step: int, rows: list[int], index: int | None) -> str:
    if index is None:
        return f"The reward function {reward.name!r} failed at step {step} on the batch of data rows {rows}"
    return (
        f"The reward function {reward.name!r} failed at step {step} on data row {rows[index]} "
        f"(completion {index} of {len(rows)})"
    )


def is_finite_score(value: Any) -> bool:
    """Whether `value` is a score: an int or float (a bool is not one), neither NaN nor infinite (a NaN would
    corrupt the advantages of its whole group). An `rl.environment`'s reward follows the same rule."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _score_one(
    reward: NamedReward,
    batch: tuple[list[str], list[str], dict[str, list[Any]]],
    step: int,
    rows: list[int],
) -> list[float]:
    """One function's scores of the batch, checked: RewardError on a raise, a wrong count, a bad value."""
    prompts, completions, columns = batch
    fix = "fix the function or the data row."  # the loop adds what the run kept (`loop.train`)
    try:
        scores = _call(reward, prompts, completions, columns)
    except Exception as exc:
        index = _first_failing_row(reward, prompts, completions, columns)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RewardError(
            f"{_where(reward, step, rows, index)}: it raised {type(exc).__name__}: {why}; {fix}"
        ) from None
    if not isinstance(scores, Sequence) or isinstance(scores, str) or len(scores) != len(completions):
        got = f"{len(scores)} scores" if isinstance(scores, Sequence) else f"a {type(scores).__name__}"
        raise RewardError(
            f"{_where(reward, step, rows, None)}: it returned {got} for {len(completions)} completions, and must "
            f"return one float per completion (a list of {len(completions)}); {fix}"
        )
    for i, value in enumerate(scores):
        if not is_finite_score(value):
            raise RewardError(
                f"{_where(reward, step, rows, i)}: it returned {value!r}, and every score must be a finite "
                f"number (a NaN or None would corrupt the advantages of the whole group); {fix}"
            )
    return [float(v) for v in scores]


def score_completions(
    rewards: Sequence[NamedReward],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
    step: int,
    rows: list[int],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the weighted sum of the rewards, float64 [N]; each function's own scores by name, float64 [N]) for
    N completions; `rows[i]` is completion i's data row, named by a RewardError."""
    n = len(completions)
    if len(prompts) != n or len(rows) != n or any(len(v) != n for v in columns.values()):
        raise ValueError("score_completions: prompts, rows and every column need one entry per completion")
    total = torch.zeros(n, dtype=torch.float64)
    each: dict[str, torch.Tensor] = {}
    for reward in rewards:
        scores = torch.tensor(
            _score_one(reward, (prompts, completions, columns), step, rows), dtype=torch.float64
        )
        each[reward.name] = scores
        total += reward.weight * scores
    return total, each
