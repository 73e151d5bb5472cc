"""An `rl.environment` (`module:Class`) as the turn loop calls it: its protocol, and every call checked.

An environment is the user's code, as a reward function is, so it follows the reward functions' rule
(`zerofit.objectives.grpo.rewards`): a constructor, `reset` or `step` that raises, or returns something
outside the protocol below, is a bug to fix, not data for the policy to learn from. Each such failure becomes
one paragraph (`EnvironmentFailed`) naming the class, the method, where in the run (step, data record,
completion, turn), what went wrong and the fix; the rollout agrees on it across ranks as on a failed reward
(`zerofit.loop.rollout.Rollouts.agreed_score`), so the run stops with that paragraph once, exit code 2.
(A tool's failure is the other kind: its error is the tool's reply, which the policy reads and learns from,
`zerofit.objectives.grpo.tools`.) An environment that wants the policy to learn from a bad turn answers it
with messages and a low reward, never an exception.

The protocol: `reset(row, seed)` returns a list of messages, `step(text)` a tuple (messages, reward,
done); a message is a dict with a string `role` and a string `content` (other keys are passed on to the
chat template), a reward a finite number (`is_finite_score`: what a reward function's score must be), done a
bool.

The first prompt of a trajectory (the row's prompt, the messages `reset` gives, the tools' schemas) must fit
`rl.max_prompt_length`: `first_prompt_too_long` words that rule once, for the launch's check of every record
(`zerofit.recipe.tools.first_prompts`) and the rollout's of each trajectory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from zerofit.core.errors import ZerofitError
from zerofit.objectives.grpo.rewards import is_finite_score

__all__ = ["CheckedEnvironment", "Environment", "EnvironmentFailed", "first_prompt_too_long"]

_FIX = (
    "an environment is your code, as a reward function is: fix it, and answer a turn it cannot use with "
    "messages and a low reward rather than an exception"
)
_SHOWN = 120  # characters of a bad return value said in the paragraph


class Environment(Protocol):
    """What `rl.environment: module:Class` names: one instance per completion, built with no arguments."""

    def reset(self, row: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        """The messages that follow the row's prompt (may be none), from the row's columns and a seed."""
        ...

    def step(self, text: str) -> tuple[list[dict[str, Any]], float, bool]:
        """The assistant's turn text -> the next messages, a reward contribution, and whether it is done."""
        ...


class EnvironmentFailed(ZerofitError):
    """An `rl.environment` raised, or returned something outside its protocol: one paragraph naming the class,
    the method, where, what and the fix (module docstring)."""


def first_prompt_too_long(where: str, length: int, limit: int, environment: bool) -> str:
    """The paragraph refusing a trajectory's first prompt of `length` tokens over `rl.max_prompt_length`
    (`limit`); `environment`: its messages include what `rl.environment`'s reset gave."""
    what, fix = "with the tools' schemas (rl.tools", "or offer fewer tools"
    if environment:
        what = "with the messages rl.environment's reset gave and the tools' schemas (rl.tools"
        fix = "shorten what reset returns, or offer fewer tools"
    return (
        f"{where}: its prompt {what}, rendered by the chat template) is {length:,} tokens, more than "
        f"rl.max_prompt_length = {limit:,}; raise rl.max_prompt_length to at least that, {fix}."
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _bad_messages(value: Any) -> str | None:
    """Why `value` is not a list of messages (None: it is one)."""
    if not isinstance(value, list):
        return f"a {type(value).__name__}, not a list"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"item {i} is a {type(message).__name__}, not a dict"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"item {i} has no string {key!r}"
    return None


def _bad_done(value: Any) -> bool:
    """Whether `value` is not a bool (numpy's bool is one)."""
    return type(value).__name__ not in ("bool", "bool_")


class CheckedEnvironment:
    """The class `rl.environment` names, its instances built, reset and stepped with every call checked."""

    def __init__(self, cls: Callable[[], Any]) -> None:
        self.cls = cls
        self.name = f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls)}"

    def _failed(self, method: str, where: str, what: str) -> EnvironmentFailed:
        return EnvironmentFailed(
            f"The environment {self.name} failed in {method} on {where}: {what}; {_FIX}."
        )

    def _call(self, method: str, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise self._failed(method, where, f"it raised {type(exc).__name__}: {why}") from None

    def begin(self, row: dict[str, Any], seed: int, where: str) -> tuple[Any, list[dict[str, Any]]]:
        """A new instance for one trajectory and the messages its `reset(row, seed)` gives, checked."""
        env = self._call(f"{self.name.split(':')[-1]}()", where, self.cls)
        messages = self._call("reset()", where, getattr(env, "reset", None) or _missing("reset"), row, seed)
        bad = _bad_messages(messages)
        if bad is not None:
            raise self._failed(
                "reset()",
                where,
                f"it returned {_shown(messages)} ({bad}), and reset must return a list of messages, each a "
                "dict with a string 'role' and a string 'content'",
            )
        return env, messages

    def step(self, env: Any, text: str, where: str) -> tuple[list[dict[str, Any]], float, bool]:
        """`env.step(text)`, checked: (the next messages, the reward as a float, done)."""
        out = self._call("step()", where, getattr(env, "step", None) or _missing("step"), text)
        rule = (
            "step must return a tuple (messages, reward, done): a list of {'role': str, 'content': str} "
            "dicts, a finite number and a bool"
        )
        if not isinstance(out, tuple | list) or len(out) != 3:
            raise self._failed("step()", where, f"it returned {_shown(out)}, and {rule}")
        messages, reward, done = out
        bad = _bad_messages(messages)
        if bad is None and not is_finite_score(reward):
            bad = f"its reward {reward!r} is not a finite int or float"
        if bad is None and _bad_done(done):
            bad = f"its done {done!r} is a {type(done).__name__}"
        if bad is not None:
            raise self._failed("step()", where, f"it returned {_shown(out)} ({bad}), and {rule}")
        return messages, float(reward), bool(done)


def _missing(method: str) -> Callable[..., Any]:
    """What an instance without `method` is called as: it raises, and the paragraph says so."""

    def missing(*args: Any) -> Any:
        raise AttributeError(f"the class defines no {method} method")

    return missing
