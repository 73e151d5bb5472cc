"""Checkpoint file writes whose failure is a fact to report, not a crash in the middle of a collective save.

A full disk (or a quota, a read-only remount, a vanished network share) can fail any write of a checkpoint.
The checkpointer turns such a failure into one paragraph on every rank, but only if every rank gets to the
point where the ranks compare notes: a rank that raises from inside an engine's collective save leaves its
peers waiting in that save's barrier. So:

- `torch_save` writes through a Python file, so a full disk raises `OSError(ENOSPC, ..., path)` (torch's
  zip writer given a path raises `RuntimeError: [enforce fail at inline_container.cc]` without an errno);
- `WriteGuard` wraps an engine's per-file save function (DeepSpeed's checkpoint engine): the first write
  that fails is recorded and the later ones are skipped, so the engine's collectives still run on every
  rank; the caller re-raises the recorded error once the engine's save has returned;
- `write_failure` says whether an exception is a failed write (and what failed), including DCP's
  `CheckpointException`, which already carries every rank's error to every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import ZerofitError

__all__ = ["WriteGuard", "torch_save", "write_failure"]

# What torch's zip writer says when the bytes it wrote did not reach the file (given a path, not a file).
_TORCH_WRITE_MARKERS = ("inline_container", "PytorchStreamWriter", "iostream error")


def torch_save(obj: Any, path: str | Path) -> None:
    """`torch.save(obj, path)` that fails with an `OSError` naming `path` (errno kept) when the write fails."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def write_failure(exc: BaseException) -> str | None:
    """`exc` as one line if it is a failed file write (`[Errno 28] No space left on device: 'path'`), else
    None (a bug, which keeps its traceback). DCP's `CheckpointException` counts if any rank's error does.

    A `ZerofitError` is never one: it is a refusal with its own paragraph (a run directory whose lock another
    run holds), even when raised while handling an OSError (EAGAIN from `flock` is no full disk)."""
    if isinstance(exc, ZerofitError):
        return None
    if isinstance(exc, OSError):
        return _describe_os_error(exc)
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _TORCH_WRITE_MARKERS):
        return f"torch could not write the file ({_first_line(exc)})"
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.CheckpointException
    if isinstance(failures, dict):
        for rank, (inner, _trace) in sorted(failures.items()):
            described = write_failure(inner)
            if described is not None:
                return f"rank {rank}: {described}" if len(failures) > 1 else described
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return write_failure(cause) if isinstance(cause, OSError) else None


def _describe_os_error(exc: OSError) -> str:
    text = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno is not None else _first_line(exc)
    # A failed copy (shutil.copyfile) names the source first and the file being written second.
    name = exc.filename2 or exc.filename
    return f"{text}: '{name}'" if name else text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class WriteGuard:
    """Wraps an engine's file-writing functions: the first failed write is kept in `error` instead of
    raised, and every later write is skipped, so the engine's save (and its barriers) completes on every
    rank. `raise_recorded` raises it afterwards."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def wrap(self, write: Callable[..., Any], path_index: int | None = None) -> Callable[..., Any]:
        """`write` that records a failed write instead of raising it (other errors raise as before);
        `path_index` is the position of the file argument, to name the file when the error does not."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.error is not None:
                return None  # the checkpoint is lost already: don't fill the disk further
            try:
                return write(*args, **kwargs)
            except (OSError, RuntimeError) as exc:
                if write_failure(exc) is None:
                    raise
                path = args[path_index] if path_index is not None and len(args) > path_index else None
                self.error = _with_path(exc, kwargs.get("path", path))
                return None

        return guarded

    @contextmanager
    def guarding(self, *targets: tuple[object, str, int | None]) -> Iterator[None]:
        """Inside the block, each `(object, attribute, path_index)` method that exists is `wrap`ped."""
        patched: list[tuple[object, str, Any]] = []
        try:
            for obj, name, path_index in targets:
                if hasattr(obj, name):  # an engine version without this function writes nothing through it
                    patched.append((obj, name, vars(obj).get(name, _ABSENT)))
                    setattr(obj, name, self.wrap(getattr(obj, name), path_index))
            yield
        finally:
            for obj, name, previous in reversed(patched):
                if previous is _ABSENT:
                    delattr(obj, name)  # the class's method shows through again
                else:
                    setattr(obj, name, previous)

    def raise_recorded(self) -> None:
        """Raise the recorded failed write, if any (after the engine's collective save returned)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error


_ABSENT = object()


def _with_path(exc: BaseException, path: Any) -> BaseException:
    """A failed write as an `OSError` naming the file when the engine's error did not."""
    if isinstance(exc, OSError) and exc.filename:
        return exc
    if path is None:
        return exc
    errno = exc.errno if isinstance(exc, OSError) else None
    strerror = exc.strerror if isinstance(exc, OSError) else None
    return OSError(errno, strerror or f"write failed ({_first_line(exc)})", os.fspath(path))
