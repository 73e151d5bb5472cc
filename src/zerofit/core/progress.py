"""Progress of a long phase the user waits through: the one helper every such phase reports through
(DeepSpeed's start, the built-in model's build and conversion, tokenizing, DPO's reference pass, the training
and a GRPO rollout, an export, the demo's scoring).

A timer thread prints one line on stdout, where the step lines and every other progress line go, whenever the
process has printed nothing for `every_s` seconds while the phase lasts (a phase's own lines, such as the
step lines, count: `messages.said`), so a phase whose items are slow (one GGUF read, one generate call)
reports at that pace too; never a line per item, never control codes (a launcher pipes its ranks' output,
CI keeps logs, `make demo` may be piped into a file):

    zerofit: scoring 36 held-out prompts, base model and trained adapter (the base model): 32/72 replies, 41 s, eta 51 s
    zerofit: converting smollm2-135m-instruct (dequantizing its GGUF tensors): 120/272 tensors, 30 s, eta 38 s
    zerofit: scoring 36 held-out prompts, base model and trained adapter: done in 88 s

and, when it printed any, one line when the phase ends; a phase shorter than `every_s` prints nothing. A
phase inside another (the conversion inside the build) is what the outer one's timer shows while it runs.
The same on a terminal: a bar there would garble the training's own (rich draws one live display per
terminal); that bar counts as a line whenever it moves.

`every_s` is `ZEROFIT_PROGRESS_EVERY_S` (seconds, default 10): no phase goes longer than that without a line.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from zerofit.core.messages import quiet_for, say

__all__ = ["EVERY_S_ENV", "Progress", "every_s", "progress"]

EVERY_S_ENV = "ZEROFIT_PROGRESS_EVERY_S"
_DEFAULT_EVERY_S = 10.0
_MIB = 1 << 20
_SLACK_S = 0.05  # a timer that wakes this early is on time


def every_s() -> float:
    """Seconds between two progress lines: `$ZEROFIT_PROGRESS_EVERY_S`, else 10 (an unusable value too)."""
    try:
        value = float(os.environ.get(EVERY_S_ENV, ""))
    except ValueError:
        return _DEFAULT_EVERY_S
    return value if value > 0 else _DEFAULT_EVERY_S


def _amount(value: float, unit: str) -> str:
    """`12.3 MiB` for bytes, else the count."""
    return f"{value / _MIB:.1f}" if unit == "B" else f"{value:,.0f}"


class Progress:
    """How far a phase is: `update(done)` (or `advance`) as it goes; `status` says which part it is in."""

    def __init__(
        self, what: str, total: float | None = None, unit: str = "", emit: Callable[[str], None] = say
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0.0
        self.status = ""
        self.started = time.monotonic()
        self.lines = 0  # progress lines printed so far
        self._emit = emit

    def update(
        self, done: float | None = None, *, total: float | None = None, status: str | None = None
    ) -> None:
        """Record how much is done (and, when it changed, the total or the part the phase is in)."""
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        if status is not None:
            self.status = status

    def advance(self, n: float = 1) -> None:
        """`n` more items done."""
        self.update(self.done + n)

    def _where(self) -> str:
        """`scoring 72 replies (trained): 32/72 replies`: the phase, its part, its count."""
        text = f"{self.what}{f' ({self.status})' if self.status else ''}"
        if self.total:
            unit = " MiB" if self.unit == "B" else (f" {self.unit}" if self.unit else "")
            text += f": {_amount(self.done, self.unit)}/{_amount(self.total, self.unit)}{unit}"
        return text

    def line(self) -> str:
        """`zerofit: scoring 72 replies (trained): 32/72 replies, 41 s, eta 51 s`: where the phase is now."""
        elapsed = time.monotonic() - self.started
        text = f"zerofit: {self._where()}{',' if self.total else ':'} {elapsed:.0f} s"
        if self.total and 0 < self.done < self.total:
            text += f", eta {elapsed / self.done * (self.total - self.done):.0f} s"
        return text

    def tick(self) -> None:
        """Print where the phase is (the timer thread calls it every `every_s`)."""
        self.lines += 1
        self._emit(self.line())

    def finish(self) -> None:
        """The closing line, when the phase printed any (a short phase stays silent)."""
        if self.lines:
            self._emit(f"zerofit: {self.what}: done in {time.monotonic() - self.started:.0f} s")


# The phases reporting now in this process, outermost first: a phase inside another (the conversion inside
# the built-in model's build) is shown by the outer one's timer thread while it runs.
_reporting: list[Progress] = []


def _tick_innermost() -> None:
    """Print the line of the innermost phase reporting now."""
    phases = list(_reporting)
    if not phases:  # the phase ended as the timer fired
        return
    phases[-1].tick()
    for outer in phases[:-1]:  # each outer phase printed through it, and gets its closing line too
        outer.lines += 1


def _due(quiet: float, interval: float) -> tuple[bool, float]:
    """The timer's rule: (print a line now?, seconds to sleep then), after `quiet` seconds without a line."""
    if quiet >= interval - _SLACK_S:
        return True, interval
    return False, interval - quiet


def _ticking(interval: float) -> tuple[threading.Event, threading.Thread]:
    """A daemon thread printing the innermost phase's line whenever this process printed nothing for
    `interval` seconds (a phase's own lines, such as the training's step lines, count: `messages.said`),
    until the event is set."""
    stop = threading.Event()

    def run() -> None:
        delay = interval
        while not stop.wait(delay):
            now, delay = _due(quiet_for(), interval)
            if now:
                _tick_innermost()

    thread = threading.Thread(target=run, name="zerofit-progress", daemon=True)
    thread.start()
    return stop, thread


@contextmanager
def progress(
    what: str, total: float | None = None, unit: str = "", *, enabled: bool = True
) -> Iterator[Progress]:
    """Report the phase `what` while the block runs (module docstring); `total` in `unit` ("B": bytes,
    shown in MiB; None: no count, the time only). `enabled` False (a rank other than 0): nothing is printed,
    and the yielded `Progress` still takes updates. Inside a phase reporting already, this one is what that
    phase's timer prints while it runs."""
    state = Progress(what, total, unit)
    if not enabled:
        yield state
        return
    outermost = not _reporting
    _reporting.append(state)
    stop, thread = _ticking(every_s()) if outermost else (None, None)
    try:
        yield state
    finally:
        _reporting.remove(state)
        if stop is not None and thread is not None:
            stop.set()
            thread.join()
    state.finish()
