"""Reward functions (`zerofit.objectives.grpo.rewards`): the built-ins on hand-checked completions, and the one
paragraph that stops a run when a reward function raises, miscounts or returns a NaN."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from zerofit.core.errors import RewardError, ZerofitError
from zerofit.objectives.grpo.rewards import (
    NamedReward,
    answers_equal,
    exact_match,
    final_answer,
    format_regex,
    length,
    score_completions,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("2 + 3 = 5, so the answer is 5.", "5"),  # no marker: the last number
        ("We get 1,000 apples.", "1,000"),
        ("3-2=1", "1"),  # a minus between terms is no sign
        ("it is -5", "-5"),
        ("first 7 then \\boxed{\\frac{1}{2}} and 9", "\\frac{1}{2}"),  # boxed: its content, as it is
        ("12 steps\n#### 72\nthen 13", "72"),  # GSM8K's marker beats a later number
        ("Answer: 42 apples", "42"),
        ("answer = $1,000.00", "$1,000.00"),
        ("Paris", "Paris"),
    ],
)
def test_final_answer_rules(text: str, answer: str) -> None:
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("answer", "reference", "equal"),
    [
        ("1,000", "1000", True),
        ("1000.0", 1000, True),
        ("$1,000.00", "1000", True),
        ("1000.", "1e3", False),  # scientific notation is not a number here: compared as text
        ("72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", True),  # a GSM8K reference's own answer
        ("paris.", "Paris", True),
        ("7", "8", False),
        ("0.5", ".5", True),
    ],
)
def test_answers_equal(answer: str, reference: Any, equal: bool) -> None:
    assert answers_equal(answer, reference) is equal


def test_builtins_hand_checked() -> None:
    completions = ["so it is 1,000", "<a>12</a>", "nothing", "\\boxed{7}"]
    prompts = ["p"] * 4
    columns = {"answer": ["1000", 12, "x", "7.0"]}
    assert exact_match("answer")(prompts, completions, columns) == [1.0, 1.0, 0.0, 1.0]
    assert format_regex(r"<a>\d+</a>")(prompts, [" <a>12</a>\n", "<a>12</a> more", "<a>\n</a>", ""], {}) == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    # one token per character: 4 tokens is the target; 2 or 6 earn half; 0 or 8 or more earn nothing
    reward = length(4, len)
    assert reward(["p"] * 5, ["abcd", "ab", "abcdef", "", "abcdefghij"], {}) == [1.0, 0.5, 0.5, 0.0, 0.0]


def test_exact_match_without_its_column_names_the_columns() -> None:
    with pytest.raises(KeyError, match="no column 'answer' \\(its columns: 'solution'\\)"):
        exact_match("answer")(["p"], ["1"], {"solution": ["1"]})


def test_score_completions_sums_by_weight_in_float64() -> None:
    rewards = [
        NamedReward("exact_match", 2.0, exact_match("answer")),
        NamedReward("format_regex", 0.5, format_regex(r".*\d")),
    ]
    total, each = score_completions(
        rewards, ["p", "q"], ["5", "six"], {"answer": ["5", "6"]}, step=3, rows=[0, 1]
    )
    assert total.dtype == torch.float64 and each["exact_match"].dtype == torch.float64
    assert total.tolist() == [2.5, 0.0]
    assert each["exact_match"].tolist() == [1.0, 0.0] and each["format_regex"].tolist() == [1.0, 0.0]


def _raises_on_row_two(
    prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
) -> list[float]:
    return [1.0 / (len(c) - 3) for c in completions]  # "abc" divides by zero


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (
            _raises_on_row_two,
            r"'mine' failed at step 7 on data row 12 \(completion 2 of 3\): it raised ZeroDivisionError",
        ),
        (
            lambda p, c, k: [1.0, 2.0],
            r"'mine' failed at step 7 on the batch of data rows \[10, 11, 12\]: it "
            r"returned 2 scores for 3 completions",
        ),
        (
            lambda p, c, k: [1.0, math.nan, 0.0],
            r"'mine' failed at step 7 on data row 11 \(completion 1 of 3\): it "
            r"returned nan",
        ),
        (lambda p, c, k: [1.0, 0.0, None], r"on data row 12 \(completion 2 of 3\): it returned None"),
        (lambda p, c, k: 1.0, r"returned a float for 3 completions"),
    ],
    ids=["raises", "wrong-count", "nan", "none", "not-a-list"],
)
def test_a_bad_reward_is_one_paragraph_naming_function_step_and_row(fn: Any, expected: str) -> None:
    rewards = [NamedReward("fine", 1.0, lambda p, c, k: [0.0] * len(c)), NamedReward("mine", 1.0, fn)]
    with pytest.raises(RewardError, match=expected) as caught:
        score_completions(rewards, ["p"] * 3, ["abcd", "abcde", "abc"], {}, step=7, rows=[10, 11, 12])
    assert isinstance(caught.value, ZerofitError)  # the launcher prints it as one paragraph, no traceback
    assert "\n" not in str(caught.value) and str(caught.value).endswith("fix the function or the data row.")
