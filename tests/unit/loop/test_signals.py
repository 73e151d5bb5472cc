"""SIGTERM / SIGINT as a stop request: the phases of `StopSignal`, the vote that makes every rank stop after
the same step, and the parent-death request (the launcher-level behaviour is in
tests/distributed/test_stop_resume.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerofit.loop.signals import StopSignal

SRC = str(Path(__file__).resolve().parents[3] / "src")


class _Exit(Exception):
    pass


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise _Exit

    monkeypatch.setattr(os, "_exit", fake_exit)
    return codes


def test_before_training_a_signal_exits_at_once(exits: list[int], capfd: pytest.CaptureFixture[str]) -> None:
    stop = StopSignal()
    with pytest.raises(_Exit):
        stop._handle(signal.SIGINT, None)
    assert exits == [130] and "before training started" in capfd.readouterr().err


def test_in_training_the_first_signal_is_a_request_and_a_later_second_one_aborts(
    exits: list[int], capfd: pytest.CaptureFixture[str]
) -> None:
    stop = StopSignal(same_request_s=0.05)
    stop.arm("runs/x")
    stop._handle(signal.SIGTERM, None)
    assert stop.requested and not exits
    assert "stopping after the current optimizer step" in capfd.readouterr().err
    stop._handle(signal.SIGTERM, None)  # the launcher forwarding the same request: not an abort
    assert not exits
    time.sleep(0.06)
    with pytest.raises(_Exit):
        stop._handle(signal.SIGINT, None)
    assert exits == [130] and "stopped at once without saving" in capfd.readouterr().err


def test_once_the_stop_checkpoint_is_written_signals_change_nothing(exits: list[int]) -> None:
    stop = StopSignal(same_request_s=0.0)
    stop.arm("runs/x")
    stop._handle(signal.SIGINT, None)
    stop.stopped()
    stop._handle(signal.SIGTERM, None)  # e.g. deepspeed's launch.py terminating the remaining ranks
    assert not exits and stop.signum == signal.SIGINT


def test_every_rank_stops_for_the_same_signal() -> None:
    stop = StopSignal()
    assert stop.votes() == [0, 0] and not stop.agree([0, 0]) and stop.agreed is None
    stop.signum = signal.SIGINT
    # Summed over ranks: one rank got SIGINT, another SIGTERM -> everyone stops for SIGTERM (143).
    assert stop.votes() == [0, 1] and stop.agree([1, 1]) and stop.agreed == signal.SIGTERM
    assert StopSignal.exit_code(signal.SIGINT) == 130


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_child_dies_with_its_parent() -> None:
    import psutil

    # parent -> child (asks for the parent-death signal, then sleeps); the parent exits: the child must go.
    child = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from zerofit.loop.signals import die_with_parent; "
        "assert die_with_parent(); print('armed', flush=True); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
        "stdout=subprocess.PIPE, text=True); print(p.pid, p.stdout.readline().strip(), flush=True)"
    )
    out = subprocess.run(
        [sys.executable, "-c", parent, child, SRC], capture_output=True, text=True, timeout=60
    )
    pid, state = out.stdout.split()
    assert state == "armed"
    try:
        proc = psutil.Process(int(pid))
        proc.wait(timeout=10)  # gone (or a zombie waiting to be reaped: dead all the same)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        proc.kill()
        pytest.fail("the child outlived its parent")
