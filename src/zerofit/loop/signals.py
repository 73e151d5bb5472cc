"""Stopping a run without losing work: SIGTERM / SIGINT, and workers that outlive their launcher.

A preempted VM, a SLURM time limit and a user's Ctrl-C all arrive as SIGTERM or SIGINT. `StopSignal` turns
the first one into a *request*: the training loop finishes the optimizer step in progress, every rank agrees
on stopping at that same step (the loop all-reduces the request after each step), a complete checkpoint is
saved, and the run exits with 128 + the signal (143 for SIGTERM, 130 for SIGINT) after one line that says
how to resume. A second signal aborts at once without saving (the last complete checkpoint stays valid:
checkpoints are atomic).

Before training starts (model loading, resume) there is nothing to save, so a signal exits at once; once
the stop checkpoint is written, later signals are ignored (a launcher terminating the remaining ranks).

How the launchers deliver signals, and why a second signal within `SAME_REQUEST_S` is not an abort:

- `python`: the process gets the signal itself (Ctrl-C in a terminal, `kill`).
- `torchrun`: its agent catches SIGTERM/SIGINT and forwards the same signal to every worker (they run in
  their own sessions, so a terminal's Ctrl-C reaches only the agent); after 30 s it sends SIGKILL.
- `deepspeed`: Ctrl-C reaches the runner, `launch.py` and every rank (one process group); `launch.py` then
  also sends SIGTERM to each rank in turn, waiting up to 30 s for each before SIGKILL. A rank thus sees
  the terminal's SIGINT and the launcher's SIGTERM within milliseconds: one request, not two.

`die_with_parent` makes a launched worker exit when its launcher dies (Linux `PR_SET_PDEATHSIG`):
`torchrun` starts workers in new sessions, so killing its process group would otherwise leave them
training, and writing checkpoints that race a resume started right away. Under `deepspeed` a rank's parent
is the runner's `launch.py`, not the `deepspeed` runner the user started: killing the runner alone (its pid,
SIGTERM or SIGKILL) leaves `launch.py` and the ranks training unwatched. `die_with_launcher` watches that
runner from a daemon thread of each rank (a pidfd, no polling) and ends the rank as its death would;
`launch.py` then exits with its children. (A signal to the whole group, which kills the runner too, still
stops with a checkpoint: the rank got that signal as well.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

__all__ = ["SAME_REQUEST_S", "StopSignal", "deepspeed_runner", "die_with_launcher", "die_with_parent"]

# Signals closer together than this are one request (a terminal and a launcher both delivering it).
SAME_REQUEST_S = 2.0
_HANDLED = (signal.SIGTERM, signal.SIGINT)


def _write(message: str) -> None:
    # os.write, not print: a Python handler may run in the middle of a print on the main thread, and
    # re-entering a buffered stream from there raises.
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), (message + "\n").encode())


class StopSignal:
    """SIGTERM/SIGINT as a request to stop after the current optimizer step; see the module docstring.

    Phases: `setup` (a signal exits at once: nothing to save yet), `training` (a signal is a request the
    loop acts on at the next step boundary; a second one, later than `SAME_REQUEST_S`, aborts at once),
    `stopped` (the stop checkpoint is written; further signals are ignored).
    """

    def __init__(self, rank: int = 0, *, same_request_s: float = SAME_REQUEST_S) -> None:
        self.rank = rank
        self.same_request_s = same_request_s
        self.phase = "setup"
        self.signum: int | None = None  # the signal this process received
        self.agreed: int | None = None  # the signal every rank stops for (set by `agree`)
        self._first_at = 0.0
        self._where = ""

    def install(self) -> StopSignal:
        """Handle SIGTERM and SIGINT in this process (the main thread must call it)."""
        for sig in _HANDLED:
            signal.signal(sig, self._handle)
        return self

    def arm(self, where: str) -> None:
        """Training starts: from now on a signal is a request to stop and save. `where` names the run."""
        self.phase = "training"
        self._where = where

    def stopped(self) -> None:
        """The stop checkpoint is written: later signals change nothing."""
        self.phase = "stopped"

    @property
    def requested(self) -> bool:
        """True once this process received a stop request."""
        return self.signum is not None

    def votes(self) -> list[int]:
        """This rank's vote per handled signal (SIGTERM, SIGINT), to be summed over the ranks."""
        return [int(self.signum == sig) for sig in _HANDLED]

    def agree(self, votes: list[int]) -> bool:
        """Given the votes summed over all ranks: stop now? Records the signal the run stops for (SIGTERM
        when ranks got different ones: a scheduler's SIGTERM outranks a stray Ctrl-C)."""
        for sig, count in zip(_HANDLED, votes, strict=True):
            if count:
                self.agreed = int(sig)
                return True
        return False

    @staticmethod
    def exit_code(signum: int) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (143, 130)."""
        return 128 + signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.phase == "stopped":
            return
        if self.phase == "setup":
            if self.rank == 0:
                _write(f"zerofit: {name} before training started: exiting (nothing to save yet)")
            os._exit(self.exit_code(signum))
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if self.rank == 0:
                _write(
                    f"zerofit: {name}: stopping after the current optimizer step and saving a checkpoint "
                    f"(send {name} again to stop at once without saving)"
                )
            return
        if now - self._first_at < self.same_request_s:
            return  # the same request, delivered twice (terminal + launcher)
        _write(
            f"zerofit (rank {self.rank}): second {name}: stopped at once without saving; the last complete "
            f"checkpoint in {self._where} is where a resume starts"
        )
        os._exit(self.exit_code(signum))


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (the launcher) dies. Linux only.

    SIGKILL, not SIGTERM: a worker whose launcher is gone must not go on to save a checkpoint that races a
    resume started right away; what it loses is what a crash loses (checkpoints are atomic). Returns False
    where unsupported. If the parent died while the request was being made, exits at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(128 + int(sig))
    return True


def _cmdline(pid: int) -> list[str]:
    """The command line of process `pid` (empty if it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent_of(pid: int) -> int | None:
    """The parent pid of process `pid` from /proc (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")".
    return int(stat.rsplit(")", 1)[1].split()[1])


def deepspeed_runner() -> int | None:
    """The pid of the `deepspeed` runner that started this rank through its `launch.py`, or None when this
    process was not started that way (torchrun, python, or launch.py run by something else, e.g. pdsh)."""
    launch = os.getppid()
    if "deepspeed.launcher.launch" not in _cmdline(launch):
        return None
    runner = _parent_of(launch)
    if runner is None or runner <= 1 or not any("deepspeed" in part for part in _cmdline(runner)):
        return None
    return runner


def die_with_launcher(
    stop: StopSignal | None = None, sig: int = signal.SIGKILL, *, rank: int = 0
) -> int | None:
    """Under the `deepspeed` runner: send `sig` to this process when the runner dies alone (SIGKILL for the
    reason `die_with_parent` gives). Call it from the main thread, after `stop.install()`.

    The runner also dies, at once, of a SIGTERM or Ctrl-C sent to the whole process group: then this rank
    got the same signal, and `stop` finishes the step and saves as usual. A signal reaches every process of
    the group together, but its Python handler waits for the main thread (busy in a step), so the watch
    asks the signal module's wakeup fd, written the moment the signal arrives, after `_SETTLE_S`.
    Returns the watched pid, or None where there is nothing to watch (not under deepspeed's runner, or no
    pidfds: not Linux 5.3+).
    """
    runner = deepspeed_runner()
    if runner is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        pidfd = os.pidfd_open(runner)
    except ProcessLookupError:
        pidfd = None  # gone already
    except OSError:
        return None
    if pidfd is None or _parent_of(os.getppid()) != runner:  # died (its pid may be reused) before we looked
        _end(sig, rank, runner)
    signalled = _signal_wakeup()

    def watch() -> None:
        import select

        select.select([pidfd], [], [])  # a pidfd turns readable when its process exits
        time.sleep(_SETTLE_S)
        if signalled() or (stop is not None and stop.requested):
            return  # a signal to the whole group: this rank stops after the step, with a checkpoint
        _end(sig, rank, runner)

    threading.Thread(target=watch, name="zerofit-launcher-watch", daemon=True).start()
    return runner


# How long after the runner's death a signal sent to its whole process group has surely reached this rank.
_SETTLE_S = 1.0


def _signal_wakeup() -> Callable[[], bool]:
    """Route the signal module's wakeup fd into a pipe; returns a check: has SIGTERM or SIGINT arrived since?"""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: only the handler's own record is left to ask
        return lambda: False

    def arrived() -> bool:
        try:
            numbers = os.read(read_end, 512)  # one byte per signal: its number
        except BlockingIOError:
            return False
        return any(number in _HANDLED for number in numbers)

    return arrived


def _end(sig: int, rank: int, runner: int) -> None:
    if rank == 0:
        _write(f"zerofit: the deepspeed launcher (pid {runner}) is gone: stopping this run without saving")
    os.kill(os.getpid(), sig)
