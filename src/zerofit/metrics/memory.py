"""Memory telemetry for one rank, and the per-rank fields of `metrics.jsonl` (docs/contracts.md).

The training loop calls `memory_snapshot(device)` on every rank at each logged step, gathers the small
dicts to rank 0 with one `strategy.all_gather_object` (no per-micro-step syncs), and merges
`per_rank_fields(snapshots)` into the logged metrics. Every rank's memory is logged, not only rank 0's:
under ZeRO and FSDP the ranks differ (rank 0 often holds more), and the largest one is what runs out.

Peaks are "since the last snapshot": CUDA peak statistics and, on Linux, the process's peak RSS
(VmHWM, reset through `/proc/self/clear_refs`) are reset after each reading, so every logged step shows
the high-water mark of its own logging interval. Where VmHWM cannot be reset, the host peak is since
the start of the process; `mem/peak_scope` says which.

A snapshot is taken at every logged step (every step by default), so it is kept cheap: one read of
/proc/self/status for both the RSS and its peak, one write to reset the peak (both files opened once per
process: opening a /proc file costs more than reading it), the host's RAM read once per
process (`MemTotal` does not change), and on CUDA one `torch.cuda.memory_stats` call for every allocator
figure (`memory_allocated` and its siblings each build that whole dict again) and the device's capacity
read once per device.
"""

from __future__ import annotations

import functools
import os
import re
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from zerofit.core.precision import GIB
from zerofit.metrics.keys import MAX_PEAK, MEM_SOURCE, PEAK_GIB, rank_field

_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MEMINFO = Path("/proc/meminfo")

# Flag keys inside a snapshot (floats, so a snapshot stays `dict[str, float]`); they are turned into the
# run-level string fields `mem/source` and `mem/peak_scope` by `per_rank_fields`, not logged per rank.
_CUDA_FLAG = "_cuda"
_HOST_PEAK_RESET_FLAG = "_host_peak_reset"


_VM_RSS = re.compile(rb"^VmRSS:\s+(\d+)\s+kB", re.MULTILINE)
_VM_HWM = re.compile(rb"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)
_MEM_TOTAL = re.compile(rb"^MemTotal:\s+(\d+)\s+kB", re.MULTILINE)


class _ProcFiles:
    """/proc/self/status and /proc/self/clear_refs, each opened once per process and kept open.

    Opening a /proc file costs several times reading it (tens of µs against a few), and a snapshot is
    taken at every logged step. A read at offset 0 of the kept status descriptor regenerates the file, so
    each reading is current; a write of "5" to the kept clear_refs descriptor resets VmHWM each time. The
    descriptors belong to the process that opened them: a forked child (its own /proc/self) opens its own.
    A file that cannot be opened (not Linux, a read-only /proc) is not retried in that process.
    """

    _pid: int | None = None
    _status: int | None = None
    _clear_refs: int | None = None

    @classmethod
    def _opened(cls) -> None:
        """Open both files for this process, if not done yet (None for one that cannot be opened)."""
        if cls._pid == os.getpid():
            return
        for inherited in (cls._status, cls._clear_refs):  # a forked child's copies of its parent's files
            if inherited is not None:
                os.close(inherited)
        cls._pid = os.getpid()
        cls._status = _open_or_none(_PROC_STATUS, os.O_RDONLY)
        cls._clear_refs = _open_or_none(_CLEAR_REFS, os.O_WRONLY)

    @classmethod
    def status(cls) -> bytes | None:
        """The text of /proc/self/status now (None where it cannot be read)."""
        cls._opened()
        if cls._status is None:
            return None
        try:
            return os.pread(cls._status, 16384, 0)  # the file is about 1.5 KiB
        except OSError:
            return None

    @classmethod
    def reset_peak(cls) -> bool:
        """Reset VmHWM to the current RSS (write "5" to clear_refs); True if it worked."""
        cls._opened()
        if cls._clear_refs is None:
            return False
        try:
            os.write(cls._clear_refs, b"5")
        except OSError:
            return False
        return True


def _open_or_none(path: Path, flags: int) -> int | None:
    """A descriptor of `path` opened with `flags`, or None where it cannot be opened."""
    try:
        return os.open(path, flags)
    except OSError:
        return None


def _proc_status_rss_hwm_kib() -> tuple[float | None, float | None]:
    """The current and peak RSS (`VmRSS`, `VmHWM`, kB) from one read of /proc/self/status (Linux), each
    None where that file or field does not exist."""
    text = _ProcFiles.status()
    if text is None:
        return None, None
    rss, hwm = _VM_RSS.search(text), _VM_HWM.search(text)
    return (float(rss.group(1)) if rss else None), (float(hwm.group(1)) if hwm else None)


def _maxrss_bytes() -> float:
    """Peak RSS since process start from getrusage (KiB on Linux, bytes on macOS)."""
    maxrss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return maxrss if sys.platform == "darwin" else maxrss * 1024


@functools.cache
def _host_total_bytes() -> float | None:
    """The host's RAM (`MemTotal`), read once per process: it does not change while a run lasts."""
    try:
        with open(_MEMINFO, "rb") as meminfo:
            match = _MEM_TOTAL.search(meminfo.read())
    except OSError:
        return None
    return float(match.group(1)) * 1024 if match else None


def host_memory() -> dict[str, float]:
    """This process's current and peak resident set size in GiB; resets the peak where the OS allows.

    Returns `rss_gib`, `peak_rss_gib` and the flag telling whether the peak was reset (so the next
    reading's peak is "since this reading").
    """
    rss_kib, hwm_kib = _proc_status_rss_hwm_kib()
    if rss_kib is not None and hwm_kib is not None:
        rss, peak = rss_kib * 1024, hwm_kib * 1024
    else:  # not Linux: no current RSS without psutil; getrusage gives the peak since start
        peak = _maxrss_bytes()
        rss = peak
    reset = hwm_kib is not None and _ProcFiles.reset_peak()
    return {"rss_gib": rss / GIB, "peak_rss_gib": peak / GIB, _HOST_PEAK_RESET_FLAG: float(reset)}


@functools.cache
def _cuda_total_bytes(device: torch.device) -> float:
    """The device's memory, read once per device: it does not change while a run lasts."""
    return float(torch.cuda.get_device_properties(device).total_memory)


def _cuda_snapshot(device: torch.device) -> dict[str, float]:
    # One reading of the allocator: torch.cuda.memory_allocated, memory_reserved and max_memory_* are each
    # a key of this same dict (and each call builds the whole dict again).
    stats = torch.cuda.memory_stats(device)
    total = _cuda_total_bytes(device)
    peak = float(stats.get("allocated_bytes.all.peak", 0))
    snap = {
        "allocated_gib": float(stats.get("allocated_bytes.all.current", 0)) / GIB,
        "reserved_gib": float(stats.get("reserved_bytes.all.current", 0)) / GIB,
        PEAK_GIB: peak / GIB,
        "peak_reserved_gib": float(stats.get("reserved_bytes.all.peak", 0)) / GIB,
        "active_gib": float(stats.get("active_bytes.all.current", 0)) / GIB,
        # cudaMalloc retries mean the caching allocator had to free cache and retry: fragmentation or a
        # near-OOM, the first sign a configuration is on the edge.
        "alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "ooms": float(stats.get("num_ooms", 0)),
        "capacity_pct": 100.0 * peak / total if total else 0.0,
        "total_gib": total / GIB,
    }
    # Reset so the next snapshot's peak covers only its own logging interval.
    torch.cuda.reset_peak_memory_stats(device)
    return snap


def memory_snapshot(device: torch.device) -> dict[str, float]:
    """Memory of this rank now, with peaks since the previous call (which this call resets).

    CUDA: allocated, reserved, peak allocated and reserved, active, allocator retries, OOM count, peak as %
    of device capacity, plus host RSS (CPU offload lives there). CPU: `allocated_gib` and `reserved_gib`
    are the process RSS and `peak_gib` its peak RSS (`mem/source` = `cpu_rss` says so), `capacity_pct` is
    the peak RSS as % of host RAM. All values in GiB except counts and percentages.
    """
    host = host_memory()
    if device.type == "cuda" and torch.cuda.is_available():
        snap = _cuda_snapshot(device)
        snap.update(host)
        snap[_CUDA_FLAG] = 1.0
        return snap
    total = _host_total_bytes()
    peak = host["peak_rss_gib"]
    return {
        "allocated_gib": host["rss_gib"],
        "reserved_gib": host["rss_gib"],
        PEAK_GIB: peak,
        "capacity_pct": 100.0 * peak * GIB / total if total else 0.0,
        **host,
        _CUDA_FLAG: 0.0,
    }


def per_rank_fields(snapshots: list[dict[str, float]]) -> dict[str, Any]:
    """Flatten one snapshot per rank (in rank order) into `mem/rank{r}/<name>` fields for logging.

    Always present for every rank: `allocated_gib`, `reserved_gib`, `peak_gib` (docs/contracts.md, metrics.jsonl), plus every
    other snapshot field. Run-level fields: `mem/source` (`cuda` or `cpu_rss`), `mem/peak_scope`
    (`since_last_log` or `since_start` for host peaks) and `mem/max_peak_gib` (the largest peak of any
    rank in this interval: the number that decides whether a configuration fits).
    """
    out: dict[str, Any] = {}
    all_cuda = bool(snapshots) and all(s.get(_CUDA_FLAG, 0.0) >= 1.0 for s in snapshots)
    all_reset = bool(snapshots) and all(s.get(_HOST_PEAK_RESET_FLAG, 0.0) >= 1.0 for s in snapshots)
    for rank, snap in enumerate(snapshots):
        for name, value in snap.items():
            if not name.startswith("_"):
                out[rank_field(rank, name)] = value
    out[MEM_SOURCE] = "cuda" if all_cuda else "cpu_rss"
    # CUDA device peaks are always reset per snapshot; host (RSS) peaks only where VmHWM can be reset.
    out["mem/peak_scope"] = "since_last_log" if all_cuda or all_reset else "since_start"
    out[MAX_PEAK] = max((float(s.get(PEAK_GIB, 0.0)) for s in snapshots), default=0.0)
    return out
