"""Which rank of a launch stopped, when a collective fails because a peer is gone.

A rank killed mid-run (`kill -9`, the OOM killer, a crash) leaves the others inside or on their way to a
collective; gloo raises at once on each of them (`RuntimeError: [.../gloo/transport/tcp/pair.cc:...]
Connection reset by peer`), naming only a socket address. To name the rank instead, every rank records,
when the process group comes up, which process each rank is (`RankProcess`: host and pid, one
all-gather); after a failure, `stopped_ranks` looks at the recorded processes on this host: a rank whose
process is gone (or a zombie its launcher has not reaped yet) is the one that stopped. Ranks on other
hosts cannot be looked at from here: their loss is said as a lost connection (`collective_failure`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SETTLE_S", "RankProcess", "collective_failure", "rank_processes", "stopped_ranks"]

# What gloo's and the c10d store's errors say when the other end of a connection went away (the process
# died or its host is unreachable). gloo's transport errors all name their source file.
_LOST_CONNECTION = (
    "gloo/transport/",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
)


@dataclass(frozen=True)
class RankProcess:
    """The process a rank runs in: its host name and pid."""

    rank: int
    host: str
    pid: int

    def stopped(self) -> bool:
        """Whether this process is gone, or a zombie (dead, not reaped yet), as seen from this host; False for
        a process on another host (it cannot be looked at from here)."""
        if self.host != socket.gethostname():
            return False
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return True  # no such process (a pid reused this fast would be a new process's, not a rank's)
        return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # "pid (comm) state ...": zombie or dead


def rank_processes(all_gather_object: Callable[[Any], list[Any]]) -> list[RankProcess]:
    """Every rank's process, in rank order, through the strategy's `all_gather_object` (a collective: every
    rank calls it once the group is up)."""
    mine = (socket.gethostname(), os.getpid())
    return [RankProcess(rank, host, pid) for rank, (host, pid) in enumerate(all_gather_object(mine))]


# How long a rank whose collective failed waits for the peer's process to show as stopped: a killed process
# closes its sockets (the failure the others see) a moment before the kernel marks it dead.
SETTLE_S = 2.0


def stopped_ranks(processes: list[RankProcess], rank: int, wait_s: float = 0.0) -> list[RankProcess]:
    """The ranks other than `rank` whose process on this host is gone, looking again for up to `wait_s`
    seconds while none is."""
    deadline = time.monotonic() + wait_s
    while True:
        gone = [p for p in processes if p.rank != rank and p.stopped()]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def collective_failure(exc: BaseException) -> str | None:
    """The first line of `exc` (or of an exception it was raised from) when it is a collective's or the
    store's failure to reach a peer, else None: torch's `DistError`s (the backend's, the network's, the
    store's) and gloo's transport errors."""
    import torch.distributed as dist

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).strip()
        if isinstance(current, dist.DistError) or (
            isinstance(current, RuntimeError) and any(marker in text for marker in _LOST_CONNECTION)
        ):
            return _first_sentence(text) or type(current).__name__
        current = current.__cause__ or current.__context__
    return None


def _first_sentence(text: str) -> str:
    """gloo's message without its source location and advice: `Read error [127.0.0.1]:24979: Connection
    reset by peer` of `[.../pair.cc:537] Read error ...: Connection reset by peer. This is typically ...`."""
    line = (text.splitlines() or [""])[0]
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically")[0].rstrip(".")
