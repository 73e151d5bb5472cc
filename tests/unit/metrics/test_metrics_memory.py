"""Per-rank memory telemetry: the fields metrics.jsonl documents, peak reset between snapshots, the CUDA path."""

from __future__ import annotations

import builtins
import mmap
import os
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from zerofit.metrics import memory
from zerofit.metrics.memory import memory_snapshot, per_rank_fields


def test_cpu_snapshot_reports_rss_and_flags_source() -> None:
    snap = memory_snapshot(torch.device("cpu"))
    assert snap["allocated_gib"] > 0
    assert snap["reserved_gib"] == snap["allocated_gib"]  # RSS-based on CPU
    assert snap["peak_gib"] >= snap["allocated_gib"] * 0.5
    assert 0 < snap["capacity_pct"] < 100
    fields = per_rank_fields([snap])
    assert fields["mem/source"] == "cpu_rss"


def test_cpu_peak_is_since_last_snapshot() -> None:
    memory_snapshot(torch.device("cpu"))
    # 64 MiB of pages of its own, every one touched, then unmapped. Not a tensor: the allocator may serve one
    # from heap pages a long-lived test worker already holds (resident before and after, no peak to see).
    block = mmap.mmap(-1, 64 * 1024 * 1024)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    block.close()
    with_block = memory_snapshot(torch.device("cpu"))
    after = memory_snapshot(torch.device("cpu"))
    if per_rank_fields([with_block])["mem/peak_scope"] != "since_last_log":
        pytest.skip("VmHWM cannot be reset here (/proc/self/clear_refs not writable)")
    mib48 = 48 / 1024
    # The freed buffer shows in the peak of its own interval, not in the current RSS ...
    assert with_block["peak_gib"] - with_block["allocated_gib"] > mib48
    # ... and no longer in the next interval's peak.
    assert with_block["peak_gib"] - after["peak_gib"] > mib48


def test_per_rank_fields_names_every_rank() -> None:
    snaps = [
        {"allocated_gib": 1.0, "reserved_gib": 2.0, "peak_gib": 3.0, "ooms": 0.0, "_cuda": 1.0},
        {"allocated_gib": 1.5, "reserved_gib": 2.5, "peak_gib": 4.0, "ooms": 1.0, "_cuda": 1.0},
    ]
    fields = per_rank_fields(snaps)
    for rank in (0, 1):
        for name in ("allocated_gib", "reserved_gib", "peak_gib", "ooms"):
            assert f"mem/rank{rank}/{name}" in fields
    assert fields["mem/rank1/peak_gib"] == 4.0
    assert fields["mem/max_peak_gib"] == 4.0
    assert fields["mem/source"] == "cuda"
    assert not any(k.endswith("_cuda") for k in fields)  # flags are not logged per rank


def test_cuda_snapshot_reads_allocator_and_resets_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every allocator figure comes from one `memory_stats` reading per snapshot (torch.cuda.memory_allocated
    and its siblings would each build that dict again), the device's capacity from one read per device."""
    gib = 1 << 30
    calls: list[str] = []
    stats = {
        "allocated_bytes.all.current": 4 * gib,
        "reserved_bytes.all.current": 6 * gib,
        "allocated_bytes.all.peak": 12 * gib,
        "reserved_bytes.all.peak": 14 * gib,
        "active_bytes.all.current": 2 * gib,
        "num_alloc_retries": 3,
        "num_ooms": 1,
    }
    fake = types.SimpleNamespace(
        is_available=lambda: True,
        memory_stats=lambda d: (calls.append("stats"), stats)[1],
        get_device_properties=lambda d: (
            calls.append("properties"),
            types.SimpleNamespace(total_memory=24 * gib),
        )[1],
        reset_peak_memory_stats=lambda d: calls.append("reset"),
    )
    monkeypatch.setattr(memory.torch, "cuda", fake)
    memory._cuda_total_bytes.cache_clear()
    try:
        snap = memory_snapshot(torch.device("cuda", 0))
        memory_snapshot(torch.device("cuda", 0))
    finally:
        memory._cuda_total_bytes.cache_clear()  # no fake capacity left for a later test
    assert calls == ["stats", "properties", "reset", "stats", "reset"]
    assert snap["allocated_gib"] == 4.0
    assert snap["reserved_gib"] == 6.0
    assert snap["peak_gib"] == 12.0
    assert snap["peak_reserved_gib"] == 14.0
    assert snap["active_gib"] == 2.0
    assert snap["alloc_retries"] == 3.0
    assert snap["ooms"] == 1.0
    assert snap["capacity_pct"] == pytest.approx(50.0)
    assert snap["rss_gib"] > 0  # host memory too (offload lives there)
    assert per_rank_fields([snap, snap])["mem/source"] == "cuda"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc only")
def test_a_cpu_snapshot_reads_its_status_once_and_opens_its_files_once_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop takes a snapshot at every logged step: one read of /proc/self/status (RSS and its peak
    together) and one write resetting the peak, through files opened once per process (opening a /proc file
    costs more than reading it), while the host's RAM (/proc/meminfo) is read once; a forked child (another
    pid) opens its own /proc/self files once."""
    memory_snapshot(torch.device("cpu"))  # the process's opens and read of the host's RAM, if not done yet
    opened: list[str] = []
    reads, writes = [0], [0]
    real_open, real_os_open, real_pread, real_write = builtins.open, os.open, os.pread, os.write

    def counted(opener: Any) -> Any:
        return lambda path, *args, **kwargs: (opened.append(str(path)), opener(path, *args, **kwargs))[1]

    monkeypatch.setattr(memory, "open", counted(real_open), raising=False)
    monkeypatch.setattr(os, "open", counted(real_os_open))
    monkeypatch.setattr(os, "pread", lambda *a: (reads.__setitem__(0, reads[0] + 1), real_pread(*a))[1])
    monkeypatch.setattr(os, "write", lambda *a: (writes.__setitem__(0, writes[0] + 1), real_write(*a))[1])
    snaps = [memory_snapshot(torch.device("cpu")) for _ in range(3)]
    assert opened == [] and reads == writes == [3]
    assert all(0 < s["capacity_pct"] < 100 and s["allocated_gib"] > 0 for s in snaps)
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)  # what a forked child sees
    child = [memory_snapshot(torch.device("cpu")) for _ in range(2)]
    assert opened == ["/proc/self/status", "/proc/self/clear_refs"] and reads == writes == [5]
    assert per_rank_fields(child[-1:])["mem/peak_scope"] == per_rank_fields(snaps[-1:])["mem/peak_scope"]
