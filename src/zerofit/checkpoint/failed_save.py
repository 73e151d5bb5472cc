"""A checkpoint that could not be written: one paragraph on every rank, the partial folder removed.

The checkpointer runs each rank's writes through `attempt` (a failed write becomes a one-line description
instead of an exception), the ranks exchange those lines, and if any rank failed every rank raises the same
`CheckpointWriteError` from `save_failed`: the folder, the free space there, the checkpoint that was kept
(the newest complete one: a failed save never replaces it) and the fix.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from zerofit.checkpoint.manifest import checkpoint_folders
from zerofit.checkpoint.rundir import CHECKPOINTS
from zerofit.core.errors import (
    CheckpointWriteError,
    ConfigError,
    DataError,
    ExportWriteError,
    MetricsWriteError,
    ResumeError,
    RunFinished,
    ZerofitError,
)
from zerofit.core.run_layout import saving_dir_name, step_dir_name
from zerofit.core.writes import write_failure

if TYPE_CHECKING:
    from zerofit.strategies.base import Strategy

T = TypeVar("T")


def attempt(write: Callable[[], None]) -> str | None:
    """Run `write`; None if it succeeded, a one-line description if a file write failed (other errors raise).

    DCP raises `CheckpointException`, a BaseException, on every rank; it is caught here as well.
    """
    try:
        write()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException; the rest re-raise
        described = write_failure(exc) if isinstance(exc, Exception) or _is_dcp(exc) else None
        if described is None:
            raise
        return described
    return None


def _is_dcp(exc: BaseException) -> bool:
    return type(exc).__name__ == "CheckpointException" and isinstance(getattr(exc, "failures", None), dict)


def first_failure(failures: list[str | None]) -> str | None:
    """The first rank's failure as `rank R: ...` (the rank named when there are several), or None."""
    for rank, failure in enumerate(failures):
        if failure is not None:
            return (
                f"rank {rank}: {failure}"
                if len(failures) > 1 and not failure.startswith("rank ")
                else failure
            )
    return None


def save_failed(root: Path, step: int, failure: str, run_name: str) -> CheckpointWriteError:
    """The error every rank raises for a checkpoint `step` that could not be written into `root`."""
    kept = checkpoint_folders(root)
    free = _free_space(root)
    if kept:
        kept_step, kept_folder = kept[-1]
        size = sum(p.stat().st_size for p in kept_folder.rglob("*") if p.is_file())
        needs = f", and a checkpoint of this run takes about {_size(size)}"
        kept_text = (
            f"Kept: {step_dir_name(kept_step)} ({kept_folder}), the newest complete checkpoint, where a "
            "resume starts"
        )
        again = f"resume with the same command plus checkpoint.resume=true run_name={run_name}"
    else:
        needs, kept_text = (
            "",
            "Kept: no checkpoint (this was the run's first save), so nothing can be resumed",
        )
        again = "run the same command again"
    return CheckpointWriteError(
        f"checkpoint {step_dir_name(step)} could not be written in {root} ({failure}); that filesystem has "
        f"{free}{needs}. The run stopped at step {step}. {kept_text}; the partial {saving_dir_name(step)} "
        "was removed. Fix: free space on that filesystem (or lower checkpoint.keep_last), then "
        f"{again}; or set output_dir to a filesystem with room and start again"
    )


def export_failed(out: Path, failure: str) -> ExportWriteError:
    """The error every rank raises when the final export `out` (adapter/ or model/) could not be written."""
    run_dir = out.parent
    kept = checkpoint_folders(run_dir / CHECKPOINTS)
    if kept:
        step, folder = kept[-1]
        weights = (
            f"The trained weights are safe in {step_dir_name(step)} ({folder}), the newest complete "
            "checkpoint. Fix: free space on that filesystem, then write the export from that checkpoint with "
            f"`zerofit export {run_dir} --out {out}` (add --merge for a merged model)"
        )
    else:
        weights = (
            "No complete checkpoint of this run holds the weights. Fix: free space on that filesystem, or set "
            "output_dir to one with room, and run again"
        )
    return ExportWriteError(
        f"the final export {out} could not be written ({failure}); that filesystem has "
        f"{_free_space(run_dir)}. No partial {out.name}/ was left. {weights}"
    )


def metrics_failed(run_dir: Path, step: int, failure: str) -> MetricsWriteError:
    """The error every rank raises when rank 0 could not write the metrics of step `step` into `run_dir`.

    No checkpoint is attempted at that step (its filesystem is the one that just refused a few hundred
    bytes); the newest complete checkpoint is where a resume starts, and the resume rewinds metrics.jsonl
    to it (a torn last line included).
    """
    kept = checkpoint_folders(run_dir / CHECKPOINTS)
    if kept:
        kept_step, folder = kept[-1]
        kept_text = (
            f"Kept: {step_dir_name(kept_step)} ({folder}), the newest complete checkpoint, where a resume "
            "starts"
        )
        again = f"resume with the same command plus checkpoint.resume=true run_name={run_dir.name}"
    else:
        kept_text = "Kept: no checkpoint (none was due yet), so nothing can be resumed"
        again = "run the same command again"
    return MetricsWriteError(
        f"the metrics of step {step} could not be written in {run_dir} ({failure}); that filesystem has "
        f"{_free_space(run_dir)}. The run stopped at step {step} without saving a checkpoint there. {kept_text}. "
        f"Fix: free space on that filesystem (or lower checkpoint.keep_last), then {again}; or set output_dir "
        "to a filesystem with room and start again"
    )


def rank0_writes(strategy: Strategy, run_dir: Path, write: Callable[[], T]) -> T | None:
    """`write()` on rank 0 (the run directory's own files before the first step: its lock, config.yaml,
    the engine config, run_info.json, W&B's run id) and its result there (None on the other ranks). A
    failed write (a full disk) ends the launch on every rank with the same paragraph, instead of a
    traceback on rank 0 and the other ranks waiting for it at the next collective; so does a refusal
    (`ZerofitError`: the run directory's lock held by another run), with its own paragraph."""
    result: list[T] = []
    failure: str | None = None
    refusal: tuple[str, str, list[str]] | None = None
    if strategy.rank == 0:
        try:
            failure = attempt(lambda: result.append(write()))
        except ZerofitError as exc:
            refusal = error_parts(exc)
    failure, refusal = strategy.broadcast_object((failure, refusal))
    if refusal is not None:
        raise rebuild_error(*refusal)
    if failure is not None:
        raise run_files_failed(run_dir, failure)
    return result[0] if result else None


def error_parts(exc: ZerofitError) -> tuple[str, str, list[str]]:
    """A user error as plain data another rank can receive (its class name, message and problems)."""
    return type(exc).__name__, str(exc), list(getattr(exc, "problems", []))


def rebuild_error(kind: str, message: str, problems: list[str]) -> ZerofitError:
    """The error `error_parts` described, raised on every rank with the same paragraph: `agreed`, so the
    launcher prints it once, on rank 0."""
    if kind == "ConfigError":
        exc: ZerofitError = ConfigError(problems)
    else:
        same = {"RunFinished": RunFinished, "ResumeError": ResumeError, "DataError": DataError}
        exc = same.get(kind, ZerofitError)(message)
    exc.agreed = True
    return exc


def run_files_failed(run_dir: Path, failure: str) -> MetricsWriteError:
    """The error every rank raises when rank 0 could not write the run directory's files before training."""
    kept = checkpoint_folders(run_dir / CHECKPOINTS)
    kept_text = (
        f" Kept as they were: its checkpoints (the newest {step_dir_name(kept[-1][0])}, {kept[-1][1]})"
        if kept
        else ""
    )
    return MetricsWriteError(
        f"the run's files in {run_dir} could not be written ({failure}); that filesystem has "
        f"{_free_space(run_dir)}. Nothing was trained in this launch.{kept_text} Fix: free space on that "
        "filesystem, then run the same command again; or set output_dir to a filesystem with room"
    )


def remove_partial(tmp: Path) -> None:
    """Delete the partial `step-N.tmp` folder (rank 0, once every rank has stopped writing into it)."""
    shutil.rmtree(tmp, ignore_errors=True)


def _free_space(folder: Path) -> str:
    try:
        usage = shutil.disk_usage(folder)
    except OSError as exc:
        return f"unknown free space ({exc})"
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def _size(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
