"""A rank that stops mid-run, said by every rank left: one paragraph, no traceback (docs/contracts.md, "Entry
point").

When one rank of a multi-rank run dies (`kill -9`, the OOM killer, a crash), the others fail in their next
collective (gloo: `Connection reset by peer`), and the launcher then ends them. Each rank left turns that
failure into a `PeerLost`: which rank stopped (its process is gone from this host, `zerofit.strategies.peers`;
a rank on another host as a lost connection), what the run kept (the newest complete checkpoint) and how
to go on (the resume command), and exits with `EXIT_PEER_LOST`.
"""

from __future__ import annotations

from pathlib import Path

from zerofit.checkpoint.checkpointer import complete_checkpoints
from zerofit.core.errors import PeerLost
from zerofit.strategies.peers import SETTLE_S, RankProcess, stopped_ranks

__all__ = ["EXIT_PEER_LOST", "peer_lost"]

# The exit code of a rank whose peer stopped: sysexits' EX_TEMPFAIL (a temporary failure: run it again, here
# as a resume). The launcher's own exit code is the launcher's (deepspeed's: the first failed rank's).
EXIT_PEER_LOST = 75


def peer_lost(
    cause: str, rank: int, processes: list[RankProcess], run_dir: Path | None, again: str
) -> PeerLost:
    """The paragraph of this rank's collective that failed to reach a peer (`cause`: the failure, said by
    `zerofit.strategies.peers.collective_failure`; only such a failure is one: a peer that exited after its
    own error, said by itself, leaves this rank's own error as it is). `processes`: every rank's (none
    before the engine was up); `run_dir`: the run's folder once it is settled (None: training had not
    started); `again`: what the command adds to resume (` checkpoint.resume=true`, and the run's name when
    it took `-2`)."""
    gone = stopped_ranks(processes, rank, wait_s=SETTLE_S)
    if gone:
        ranks = " and ".join(f"rank {p.rank} (pid {p.pid})" for p in gone)
        its = "its" if len(gone) == 1 else "their"
        who = f"{ranks} stopped (killed, out of memory or crashed: {its} own output and the launcher's say which)"
    else:
        who = "the connection to another rank of the run was lost (that rank stopped, or its host is unreachable)"
    return PeerLost(f"{who}, so rank {rank} cannot go on ({cause}). {_kept(run_dir, again)}")


def _kept(run_dir: Path | None, again: str) -> str:
    """What the run kept and how to go on once every rank can run again."""
    if run_dir is None:
        return "Training had not started, so nothing was saved: run the same command again once every rank can run"
    folders = complete_checkpoints(run_dir)
    if not folders:
        return (
            f"No checkpoint of {run_dir} was saved yet, so nothing can be resumed: run the same command again "
            "once every rank can run"
        )
    step, folder = folders[-1]
    return (
        f"The last complete checkpoint is {folder} (step {step}): once every rank can run, resume with the same "
        f"command plus{again}"
    )
