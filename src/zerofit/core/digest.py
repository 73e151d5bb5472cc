"""SHA-256 of files: the one hasher behind the tokenization cache's content key and checkpoint manifests.

`file_sha256` re-reads the file every time (what verifying a checkpoint needs). `content_sha256` is keyed
by path, size and modification time, so the data file a run hashes for the tokenization cache is not read a
second time for its checkpoint manifests; a file rewritten in place is hashed again.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

_CHUNK = 1 << 22  # 4 MiB reads: hashing speed is then the disk's (about a second per GB), not Python's


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, as hex, read now."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_sha256(path: Path) -> str:
    """`file_sha256`, remembered for as long as the file keeps its size and modification time."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _remembered(resolved, stat.st_size, stat.st_mtime_ns)


def files_sha256(paths: Iterable[Path]) -> str:
    """One SHA-256 over several files, in order (each file's `content_sha256`)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{content_sha256(path)}\0".encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=64)
def _remembered(path: Path, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # part of the key only
    return file_sha256(path)
