"""A checkpoint (or a metrics row) that cannot be written (a full disk) is one paragraph, the partial folder goes, the newest
complete checkpoint stays; the write layer recognises torch's, DCP's and DeepSpeed's failed writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config_helpers import prepared_one_process_strategy
from full_disk import fill, small_filesystem
from zerofit.checkpoint import Checkpointer, complete_checkpoints, verify
from zerofit.checkpoint.failed_save import attempt
from zerofit.config.schema import CheckpointSection
from zerofit.core.errors import CheckpointWriteError
from zerofit.core.writes import WriteGuard
from zerofit.metrics.base import JsonlSink, MultiSink


def train_demo_into(disk: Path, max_steps: int, **overrides: object) -> None:
    """The demo config trained on one process into run `r` of `disk` (a small filesystem), quietly."""
    from zerofit.api import train

    train(
        str(Path(__file__).parents[3] / "configs" / "demo.yaml"),
        **{
            "distributed.strategy": "single",
            "distributed.preset": None,
            "train.max_steps": max_steps,
            "output_dir": str(disk),
            "run_name": "r",
            "logging.console": False,
            "logging.wandb.mode": "disabled",
            **overrides,
        },
    )


def test_a_checkpoint_on_a_full_disk_is_one_paragraph_and_the_good_one_stays(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", 512) as disk:
        run_dir = disk / "run"
        ckpt = Checkpointer(
            prepared_one_process_strategy(8), run_dir, CheckpointSection(keep_last=2), max_steps=10
        )
        ckpt.save(2)
        fill(disk)
        with pytest.raises(CheckpointWriteError) as err:
            ckpt.save(4)
        text = str(err.value)
        root = run_dir / "checkpoints"
        assert f"checkpoint step-4 could not be written in {root}" in text
        assert "No space left on device" in text and "free of 512.0 KiB" in text
        assert f"Kept: step-2 ({root / 'step-2'})" in text and "the partial step-4.tmp was removed" in text
        assert "checkpoint.resume=true run_name=run" in text and "\n" not in text
        assert not (root / "step-4.tmp").exists()
        assert [step for step, _ in complete_checkpoints(run_dir)] == [2]
        verify(root / "step-2")  # the kept checkpoint is intact


def test_a_first_checkpoint_that_does_not_fit_says_nothing_was_kept(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", 256) as disk:
        ckpt = Checkpointer(prepared_one_process_strategy(8), disk / "run", CheckpointSection(), max_steps=10)
        fill(disk)
        with pytest.raises(CheckpointWriteError, match=r"Kept: no checkpoint .*run the same command again"):
            ckpt.save(1)
        assert not list((disk / "run" / "checkpoints").iterdir())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_on_a_full_disk_is_recognised_as_a_failed_write(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with small_filesystem(tmp_path / "disk", 128) as disk:
        state = {"w": torch.zeros(256, 256)}  # 256 KiB: more than the disk holds
        failure = attempt(lambda: dcp.save(state, checkpoint_id=str(disk / "dcp"), no_dist=True))
    # (In one process DCP raises torch's zip-writer error; across ranks its CheckpointException.)
    assert failure is not None and ("No space left on device" in failure or "could not write" in failure)


def test_the_write_guard_records_the_first_failed_write_and_skips_the_rest(tmp_path: Path) -> None:
    calls: list[str] = []

    def save(state: object, path: str) -> None:
        calls.append(path)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    guard = WriteGuard()
    guarded = guard.wrap(save, path_index=1)
    guarded({}, "a.pt")
    guarded({}, "b.pt")  # skipped: the checkpoint is lost already
    assert calls == ["a.pt"]
    with pytest.raises(OSError, match=r"write failed .*inline_container") as err:
        guard.raise_recorded()
    assert err.value.filename == "a.pt"

    def buggy(state: object, path: str) -> None:
        raise RuntimeError("a bug, not a write")

    with pytest.raises(RuntimeError, match="a bug"):
        WriteGuard().wrap(buggy, 1)({}, "c.pt")


def test_closing_the_sinks_goes_on_after_one_fails_to_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class FullDiskSink(JsonlSink):
        def close(self) -> None:
            raise OSError(28, "No space left on device", str(tmp_path / "summary.json"))

    after = JsonlSink(tmp_path / "b.jsonl")
    MultiSink([FullDiskSink(tmp_path / "a.jsonl"), after]).close()
    assert after._file.closed
    assert "No space left on device" in capsys.readouterr().err


def test_a_final_export_on_a_full_disk_is_one_paragraph_and_names_the_checkpoint_to_export_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zerofit.checkpoint.final_export as final_export
    from zerofit.core.errors import ExportWriteError

    write = final_export._write_export

    def on_a_full_disk(*args: object) -> None:  # the disk fills up between the last checkpoint and the export
        fill(disk)
        write(*args)

    monkeypatch.setattr(final_export, "_write_export", on_a_full_disk)
    with small_filesystem(tmp_path / "disk", 4096) as disk:
        with pytest.raises(ExportWriteError) as err:
            train_demo_into(disk, 2)
        text, run_dir = str(err.value), disk / "r"
        assert f"the final export {run_dir / 'adapter'} could not be written" in text
        assert "No space left on device" in text and "free of 4.0 MiB" in text
        assert f"safe in step-2 ({run_dir / 'checkpoints' / 'step-2'})" in text
        assert f"zerofit export {run_dir} --out {run_dir / 'adapter'}" in text and "\n" not in text
        assert not (run_dir / "adapter.tmp").exists() and not (run_dir / "adapter").exists()
        assert [step for step, _ in complete_checkpoints(run_dir)] == [2]


@pytest.mark.slow
def test_metrics_that_cannot_be_written_stop_the_run_with_one_paragraph_and_keep_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills up after the step-2 checkpoint: step 3's metrics.jsonl row cannot be written."""
    from zerofit.core.errors import MetricsWriteError

    save = Checkpointer.save

    def then_the_disk_fills(self: Checkpointer, steps_done: int) -> Path:
        folder = save(self, steps_done)
        fill(disk)
        # The last page of metrics.jsonl has room a row could use without a new block: blank lines (which
        # every reader skips) take it, so the next row needs a block the disk no longer has.
        metrics = disk / "r" / "metrics.jsonl"
        with metrics.open("a") as f:
            f.write("\n" * (-metrics.stat().st_size % 4096))
        return folder

    monkeypatch.setattr(Checkpointer, "save", then_the_disk_fills)
    with small_filesystem(tmp_path / "disk", 1024) as disk:
        with pytest.raises(MetricsWriteError) as err:
            train_demo_into(disk, 6, **{"checkpoint.every_steps": 2})
        text, run_dir = str(err.value), disk / "r"
        assert f"the metrics of step 3 could not be written in {run_dir}" in text
        assert f"No space left on device: '{run_dir / 'metrics.jsonl'}'" in text and "free of 1.0 MiB" in text
        assert f"Kept: step-2 ({run_dir / 'checkpoints' / 'step-2'})" in text
        assert "checkpoint.resume=true run_name=r" in text and "\n" not in text
        assert [step for step, _ in complete_checkpoints(run_dir)] == [2]
        verify(run_dir / "checkpoints" / "step-2")
        assert "warning" not in capsys.readouterr().err  # the paragraph alone: no second word on the disk


def test_how_the_run_ended_on_a_full_disk_is_a_warning_not_a_crash_before_the_last_barrier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerofit.metrics.summary import record_outcome

    with small_filesystem(tmp_path / "disk", 64) as disk:
        fill(disk)
        record_outcome(disk, {"stop_reason": "max_steps"})
        assert not list(disk.glob("summary.json*"))  # no half-written file left either
    err = capsys.readouterr().err
    assert f"could not be added to {disk / 'summary.json'}" in err and "No space left on device" in err


def test_a_run_directory_that_cannot_be_written_before_the_first_step_is_one_paragraph(
    tmp_path: Path,
) -> None:
    """A full disk at the start: the run directory's lock, config.yaml, run_info.json are rank 0's writes
    before any collective step; each failure is the same paragraph on every rank, not an OSError."""
    from zerofit.core.errors import MetricsWriteError

    with small_filesystem(tmp_path / "disk", 256) as disk:
        fill(disk)
        with pytest.raises(MetricsWriteError) as err:
            train_demo_into(disk, 2)
        text = str(err.value)
        assert (
            f"the run's files in {disk / 'r'} could not be written ([Errno 28] No space left on device"
            in text
        )
        assert "free of 256.0 KiB" in text and "Nothing was trained" in text and "\n" not in text
