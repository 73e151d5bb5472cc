"""A real full filesystem for tests: a small tmpfs mounted for the test's duration (needs root).

Where mounting is impossible (not root, no mount permission in a container) the test is skipped with that
reason: injecting the error instead would not show that a real `ENOSPC` from torch, DCP and DeepSpeed's
writers is reported.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(where: Path, size_kib: int) -> Iterator[Path]:
    """Mount a `size_kib` tmpfs at `where` (created) and unmount it afterwards; skips the test if it cannot."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a real full filesystem needs a tmpfs mount, which needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path, leave_bytes: int = 0) -> None:
    """Fill `folder`'s filesystem until at most `leave_bytes` are free (one filler file)."""
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with (folder / "filler").open("wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * max(free - leave_bytes, 0))
        f.flush()
