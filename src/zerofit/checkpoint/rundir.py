"""The run directory as a place on disk: can it be written, which name is free, and who is writing it.

- `check_output_location`: a file where a folder must be, or a folder this user cannot write, is refused
  before any model is loaded (and without creating anything).
- `free_name`: a new run never writes into a directory that already holds a run: it takes `-2`, `-3`, ...;
  `planned_run_dir` is that decision made ahead (`zerofit plan`), and `taken_note` the line both print.
- `lock_run_dir` / `locked_by`: rank 0 of the run writing a directory holds an exclusive `flock` on
  `.zerofit.lock` until it exits (the kernel drops it even on SIGKILL, so it never goes stale). A resume
  that finds the lock held is refused: the other run may still be saving the checkpoint it would resume
  from (a stopped run under the `deepspeed` launcher returns the prompt before its ranks have finished).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from zerofit.core.errors import ConfigError, ResumeError
from zerofit.core.run_layout import CHECKPOINTS_DIR, LOCK_FILE, check_run_name

CHECKPOINTS = CHECKPOINTS_DIR  # the name the checkpoint modules import
_held_locks: list[IO[str]] = []  # this process's lock files, open for its lifetime


def check_output_location(run_dir: Path) -> None:
    """Refuse a run directory that cannot be written (a file in the way, no permission)."""
    existing = run_dir / CHECKPOINTS
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            [
                f"output_dir/run_name = {str(run_dir)!r}: {str(existing)!r} is a file, not a folder; set "
                "output_dir (or run_name) to a folder zerofit may create"
            ]
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            [
                f"output_dir/run_name = {str(run_dir)!r}: {str(existing)!r} is not writable by this user; set "
                "output_dir to a folder you can write, or fix its permissions"
            ]
        )


def free_name(output_dir: Path, run_name: str) -> str:
    """`run_name`, or the first free `run_name-2`, `-3`, ... when `output_dir/run_name` holds a run (a name
    that is not one folder name under `output_dir` is refused, `check_run_name`)."""
    name, suffix = check_run_name(run_name), 1
    while (output_dir / name).is_dir() and any((output_dir / name).iterdir()):
        suffix += 1
        name = f"{run_name}-{suffix}"
    return name


def taken_note(output_dir: str | Path, run_name: str, name: str) -> str | None:
    """The plan's line when a new run writes `output_dir/name` because `output_dir/run_name` holds a run
    (None when `name` is the asked one): said before the run, never a silent `-2`."""
    if name == run_name:
        return None
    return (
        f"{Path(output_dir) / run_name} already holds a run, so this new run writes {Path(output_dir) / name}; "
        f"to continue that run instead, add checkpoint.resume=true; to choose the name, set run_name=NAME"
    )


def planned_run_dir(output_dir: str | Path, run_name: str, resume: bool | str) -> tuple[Path, str | None]:
    """The run directory a launch of this config would write now, and `taken_note`'s line: a new run
    (`checkpoint.resume=false`) takes the first free `-N` (`free_name`); a resume continues `run_name`."""
    name = free_name(Path(output_dir), run_name) if resume is False else check_run_name(run_name)
    return Path(output_dir) / name, taken_note(output_dir, run_name, name)


def locked_by(run_dir: Path) -> int | None:
    """The pid of a live process holding `run_dir`'s lock (a run still writing it; -1 if unknown), or None."""
    try:
        f = (run_dir / LOCK_FILE).open("r")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def held_by(run_dir: Path, pid: int | None) -> str:
    """Who holds `run_dir`'s lock, in words: `another zerofit run (pid 123) holds RUN_DIR's lock (.zerofit.lock)`
    (the pid left out when the holder has not recorded it yet)."""
    who = f"another zerofit run (pid {pid})" if pid is not None and pid > 0 else "another zerofit run"
    return f"{who} holds {run_dir}'s lock ({LOCK_FILE})"


def lock_run_dir(run_dir: Path) -> None:
    """Hold `run_dir`'s lock until this process exits (rank 0 of the run writing it); creates the folder.

    A lock already held (EAGAIN / EWOULDBLOCK: another launch with this run_name got there first) is a
    `ResumeError` that says so, raised from nothing: the OSError is not a failed write (no disk is full).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    f = (run_dir / LOCK_FILE).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ResumeError(
            f"{held_by(run_dir, locked_by(run_dir))}: it is writing that run directory (two launches with "
            "one run_name at the same time); wait for it to finish, or give this run another run_name"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held_locks.append(f)
