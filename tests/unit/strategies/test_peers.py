"""A rank that stops mid-run, as the ranks left see it: which recorded rank process is gone from this host
(`zerofit.strategies.peers`), which failures are a collective's failure to reach a peer, and the paragraph
each rank left says (`zerofit.recipe.lost_rank`). The real kill is tests/distributed/test_failures.py's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from zerofit.core.errors import CheckpointWriteError
from zerofit.recipe.lost_rank import peer_lost
from zerofit.strategies.peers import RankProcess, collective_failure, stopped_ranks

# What gloo raised on the surviving rank of a 2-rank ZeRO-2 run whose rank 1 got `kill -9`.
GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:24979: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
    "Check the logs of the remote worker before reporting an error. GLHF!"
)


@pytest.fixture
def ranks() -> Iterator[list[RankProcess]]:
    """Rank 0 is this process; rank 1 a process that was killed (a zombie until it is reaped, then gone)."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    processes = [RankProcess(0, host, os.getpid()), RankProcess(1, host, victim.pid)]
    assert stopped_ranks(processes, 0) == []
    victim.kill()
    yield processes
    victim.wait()


def test_a_killed_rank_is_seen_stopped_as_a_zombie_and_once_reaped(ranks: list[RankProcess]) -> None:
    assert stopped_ranks(ranks, 0, wait_s=10.0) == [ranks[1]]  # a zombie: its launcher has not reaped it
    os.waitpid(ranks[1].pid, 0)
    assert stopped_ranks(ranks, 0) == [ranks[1]]  # gone
    elsewhere = RankProcess(2, "another-host", ranks[1].pid)
    assert not elsewhere.stopped()  # a process on another host cannot be looked at from here


def test_a_collective_s_failure_to_reach_a_peer_is_told_from_a_bug() -> None:
    assert collective_failure(RuntimeError(GLOO)) == "Read error [127.0.0.1]:24979: Connection reset by peer"
    assert collective_failure(dist.DistNetworkError("failed to recv, got 0 bytes")) == (
        "failed to recv, got 0 bytes"
    )
    try:  # raised from one (an engine wrapping the collective's error)
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as inner:
            raise ValueError("the checkpoint's barrier failed") from inner
    except ValueError as outer:
        assert collective_failure(outer) == "Read error [127.0.0.1]:24979: Connection reset by peer"
    assert collective_failure(RuntimeError("shape mismatch: a bug")) is None
    assert collective_failure(KeyError("step")) is None
    # A rank's own error stays its own, even once a peer is gone (that peer exited after the same error).
    assert collective_failure(CheckpointWriteError("checkpoint step-2 could not be written in ...")) is None


def test_the_paragraph_names_the_rank_the_checkpoint_and_the_resume_command(
    ranks: list[RankProcess], tmp_path: Path
) -> None:
    cause = collective_failure(RuntimeError(GLOO))
    assert cause is not None
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    none_yet = str(peer_lost(cause, 0, ranks, run_dir, " checkpoint.resume=true"))
    assert none_yet.startswith(f"rank 1 (pid {ranks[1].pid}) stopped (killed, out of memory or crashed")
    assert "so rank 0 cannot go on (Read error [127.0.0.1]:24979: Connection reset by peer)" in none_yet
    assert f"No checkpoint of {run_dir} was saved yet, so nothing can be resumed" in none_yet
    for step in (2, 4):
        (run_dir / "checkpoints" / f"step-{step}").mkdir()
        (run_dir / "checkpoints" / f"step-{step}" / "manifest.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / "step-6.tmp").mkdir()  # the save the failure interrupted
    kept = str(peer_lost(cause, 0, ranks, run_dir, " checkpoint.resume=true run_name=run-2"))
    assert "\n" not in kept
    assert kept.endswith(
        f"The last complete checkpoint is {run_dir / 'checkpoints' / 'step-4'} (step 4): once every rank can "
        "run, resume with the same command plus checkpoint.resume=true run_name=run-2"
    )
    early = str(peer_lost(cause, 1, [], None, " checkpoint.resume=true"))  # before the engine was up
    assert early.startswith("the connection to another rank of the run was lost")
    assert early.endswith(
        "Training had not started, so nothing was saved: run the same command again once every rank can run"
    )
