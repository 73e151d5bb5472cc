"""The verdicts of the demos' held-out probes, the one home of each rule: the demo's scorer
(`zerofit.demo.score`) and the shipped lm-eval tasks (`tasks/*.yaml`, through the `*_result` functions their
`process_results` names) judge a reply alike. No lm-eval, and torch only for the sums (the GRPO rewards'
module): plain text in, a verdict out.

    format    a reply passes when it is exactly one JSON object {"answer": "<text>"} (the SmolLM2 demo's skill)
    capitals  a reply passes when it contains the expected answer, case-insensitively (what the base knew)
    sums      a reply passes when its final answer equals the expected one (the GRPO demo's exact_match)
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["capitals_result", "follows_format", "format_result", "knows", "sums_result"]

# The metric every shipped task reports: the share of probes that pass (lm-eval's `acc`, higher is better).
METRIC = "acc"


def follows_format(reply: str) -> bool:
    """Whether `reply` is exactly one JSON object with one key, "answer", holding a non-empty string."""
    try:
        value = json.loads(reply.strip())
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"answer"}
        and isinstance(value["answer"], str)
        and bool(value["answer"].strip())
    )


def knows(reply: str, answer: str) -> bool:
    """Whether `reply` contains `answer`, case-insensitively."""
    return answer.lower() in reply.lower()


def _reply(results: list[Any]) -> str:
    """The one generated reply lm-eval hands `process_results` for a `generate_until` probe."""
    return str(results[0]) if results else ""


def format_result(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """lm-eval's `process_results` of the format task: 1.0 when the reply `follows_format`."""
    return {METRIC: float(follows_format(_reply(results)))}


def capitals_result(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """lm-eval's `process_results` of the capitals task: 1.0 when the reply `knows` the probe's answer."""
    return {METRIC: float(knows(_reply(results), str(doc["answer"])))}


def sums_result(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """lm-eval's `process_results` of the sums task: 1.0 when the reply's final answer equals the probe's."""
    from zerofit.objectives.grpo.rewards import (
        answers_equal,
        final_answer,
    )  # torch: only where sums are judged

    return {METRIC: float(answers_equal(final_answer(_reply(results)), doc["answer"]))}
