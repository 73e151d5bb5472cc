"""Checkpoints assume one filesystem shared by every rank: check that before training, not at the first save.

Every rank writes its own part of a checkpoint into `output_dir/run_name/checkpoints/step-N.tmp/` (ZeRO
partitions, FSDP2 shards, its RNG state), rank 0 marks it complete and renames it once all are done, and a
resume reads it back on every rank. That holds only when `output_dir` is the same filesystem on every node
(NFS, Lustre, a cluster's shared home or scratch). On node-local disks each node would hold part of each
checkpoint: the first save would fail deep inside the engine on the nodes where rank 0's folder does not
exist, and a resume would find different checkpoints on different nodes.

So, before training, rank 0 writes a probe file with a fresh token into `output_dir`, and every rank must
read that token back (waiting a few seconds for a network filesystem's caches). If any rank cannot, every
rank raises the same `LaunchError`, naming the ranks and hosts that could not see rank 0's file, and the fix.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

from zerofit.checkpoint.failed_save import rank0_writes
from zerofit.core.errors import LaunchError
from zerofit.strategies.base import Strategy

__all__ = ["PROBE_PREFIX", "check_shared_output_dir"]

PROBE_PREFIX = ".zerofit-shared-fs-"
_WAIT_S = 10.0  # NFS may cache a directory's listing for a few seconds


def _sees(probe: Path, token: str, wait_s: float) -> bool:
    """True once `probe` holds `token` (polled for up to `wait_s` seconds)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if probe.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared_output_dir(strategy: Strategy, output_dir: Path, wait_s: float = _WAIT_S) -> None:
    """Raise `LaunchError` on every rank unless every rank sees rank 0's files in `output_dir` (collective;
    nothing to check for one process)."""
    if strategy.world_size == 1:
        return
    output_dir = Path(output_dir)
    token = strategy.broadcast_object(uuid.uuid4().hex if strategy.rank == 0 else None)
    probe = output_dir / f"{PROBE_PREFIX}{token}"

    def write_probe() -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)

    rank0_writes(strategy, output_dir, write_probe)  # a full disk: one paragraph on every rank
    strategy.barrier()
    seen = _sees(probe, token, wait_s)
    views = strategy.all_gather_object((strategy.rank, socket.gethostname(), seen))
    if strategy.rank == 0:
        probe.unlink(missing_ok=True)
    blind = [(rank, host) for rank, host, ok in views if not ok]
    if not blind:
        return
    who = ", ".join(f"rank {rank} on {host}" for rank, host in blind)
    raise LaunchError(
        f"output_dir = {str(output_dir)!r} is not one filesystem shared by every rank: {who} cannot see the "
        f"file rank 0 (on {views[0][1]}) wrote there. Checkpoints need it: every rank writes its part of each "
        "checkpoint into output_dir/run_name/checkpoints/ and reads it back on resume. Fix: set output_dir to "
        "a path on a filesystem every node mounts (NFS, Lustre, the cluster's shared home or scratch), the same "
        "path on every node"
    )
