"""Toy environments for agentic GRPO's demo and guide (`rl.environment: zerofit.demo.environments:Class`),
each following `zerofit.loop.environment.Environment`: built once per completion with no arguments, `reset(row,
seed)` -> the messages after the row's prompt, `step(text)` -> (next messages, reward, done).

    DigitsTwice   two turns; each earns half the share of digits in its text; the second turn is asked for
                  with the user message `more`. A random-init model writes about one digit in ten
                  characters, so the reward starts near 0.1 and rises as the policy learns to write digits.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DigitsTwice"]


class DigitsTwice:
    """Two turns, each scored by its share of digits (module docstring)."""

    turns_wanted = 2

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        """Nothing after the row's prompt: the first turn answers it."""
        self.turns = 0
        return []

    def step(self, text: str) -> tuple[list[dict[str, Any]], float, bool]:
        """Half the turn's share of digits; `more` until the second turn."""
        self.turns += 1
        share = sum(ch.isdigit() for ch in text) / max(len(text), 1)
        done = self.turns >= self.turns_wanted
        return ([] if done else [{"role": "user", "content": "more"}]), share / self.turns_wanted, done
