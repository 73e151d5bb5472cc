"""Who this process is in the launch: rank, world size, local rank, read from the launcher's environment.

`deepspeed`, `torchrun` and SLURM wrappers export RANK / WORLD_SIZE / LOCAL_RANK (+ MASTER_ADDR/PORT).
Under plain `python` nothing is set; then this is a one-process launch and the rendezvous variables are
set here, so `deepspeed.init_distributed` does not fall back to MPI discovery. No torch import: the
launcher reads the world size before anything heavy is loaded, so a bad batch fails in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# Every variable a launcher sets for a process (and `launch_env` for a one-process run).
RENDEZVOUS_VARIABLES = (*_RENDEZVOUS, "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the launch; `launched` is False for a plain `python` start."""

    rank: int
    world_size: int
    local_rank: int
    launched: bool


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_env() -> LaunchEnv:
    """Read rank/world/local rank; under plain `python`, first set the one-process rendezvous variables."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not launched:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        for key in _RENDEZVOUS:
            os.environ[key] = "1" if key == "WORLD_SIZE" else "0"
    # Launchers that export only RANK/WORLD_SIZE (some SLURM wrappers) run one process per node.
    os.environ.setdefault("LOCAL_RANK", "0")
    return LaunchEnv(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        launched=launched,
    )


@contextlib.contextmanager
def rendezvous_restored() -> Iterator[None]:
    """Around a run inside a longer-lived process (`zerofit.train`): the rendezvous variables as they were.

    `launch_env` sets them for a one-process run; left behind, a library used next in the same process
    (accelerate, TRL's trainers) reads them as a launch that is over, and a second `zerofit.train` as one
    started by a launcher.
    """
    before = {key: os.environ.get(key) for key in RENDEZVOUS_VARIABLES}
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
