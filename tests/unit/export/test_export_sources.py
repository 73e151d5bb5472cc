"""Which weights `zerofit export` / `generate` read from a run directory, and what they say when there are none;
and an `--out` that cannot be written, said as one paragraph before anything loads.

(The readers themselves run on real ZeRO-3, FSDP2 and single-process checkpoints in
tests/distributed/test_multinode_export.py.)
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from zerofit.checkpoint.manifest import MANIFEST
from zerofit.cli import main as cli
from zerofit.core.errors import ConfigError
from zerofit.trained import find_weights, read_checkpoint, read_run_config


def _checkpoint(run: Path, step: int, complete: bool = True, suffix: str = "") -> Path:
    folder = run / "checkpoints" / f"step-{step}{suffix}"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"")
    if complete:
        (folder / MANIFEST).write_text(json.dumps({"step": step}))
    return folder


def _final(run: Path, last_step: int | None, kind: str = "adapter") -> Path:
    folder = run / kind
    folder.mkdir(parents=True)
    (folder / f"{'adapter_' if kind == 'adapter' else ''}model.safetensors").write_bytes(b"")
    if last_step is not None:
        (run / "summary.json").write_text(json.dumps({"last_step": last_step}))
    return folder


def test_newest_complete_checkpoint_when_there_is_no_final_export(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, complete=False)  # a save that never finished
    _checkpoint(tmp_path, 14, suffix=".tmp")  # a save in progress
    source = find_weights(tmp_path)
    assert (source.kind, source.path, source.step) == ("checkpoint", newest, 10)
    assert source.describe() == "checkpoint step-10 (single layout)"


@pytest.mark.parametrize("kind", ["adapter", "model"])
def test_the_final_export_wins_a_tie(tmp_path: Path, kind: str) -> None:
    _checkpoint(tmp_path, 10)
    final = _final(tmp_path, 10, kind)
    source = find_weights(tmp_path)
    assert (source.kind, source.path, source.step) == (kind, final, 10)


def test_a_newer_checkpoint_beats_a_stale_final_export(tmp_path: Path) -> None:
    # Finished at step 10, resumed to run longer, stopped at a step-16 checkpoint.
    _final(tmp_path, 10)
    newer = _checkpoint(tmp_path, 16)
    assert find_weights(tmp_path).path == newer


def test_a_chosen_step(tmp_path: Path) -> None:
    two = _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    _final(tmp_path, 4)
    assert find_weights(tmp_path, step=2).path == two
    with pytest.raises(ConfigError, match=r"no complete checkpoint step-3 \(complete checkpoints: 2, 4\)"):
        find_weights(tmp_path, step=3)


@pytest.mark.parametrize("name", ["adapter_model.bin", "training_state.pt", "weights.pkl"])
def test_a_pickle_in_the_final_export_is_refused_before_it_is_read(tmp_path: Path, name: str) -> None:
    # zerofit writes its final adapter/ as safetensors only: a pickle there was put there since.
    final = _final(tmp_path, 4)
    (final / name).write_bytes(b"\x80\x04N.")  # (never read: any bytes)
    with pytest.raises(ConfigError) as err:
        find_weights(tmp_path)
    text = err.value.without_heading()
    assert (
        f"{final} is the final export adapter/ of run {tmp_path}" in text
        and f"pickled weights ({name})" in text
    )
    assert "delete or move it" in text and "\n" not in text


def test_no_weights_at_all(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2, complete=False)
    with pytest.raises(ConfigError, match="holds no trained weights"):
        find_weights(tmp_path)


def test_unknown_checkpoint_layout(tmp_path: Path) -> None:
    folder = tmp_path / "step-1"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is not a checkpoint zerofit can read"):
        read_checkpoint(folder)


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a zerofit run directory"):
        read_run_config(tmp_path)
    (tmp_path / "config.yaml").write_text("train: {max_step: 3}\n")
    with pytest.raises(ConfigError, match="does not validate with this zerofit") as err:
        read_run_config(tmp_path)
    assert "did you mean 'train.max_steps'" in str(err.value)


# ------------------------------------------------------------- where `--out` can be written


def _fake_run(run: Path) -> Path:
    """A run directory with a config and a final adapter (empty files: enough to get past the checks)."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run_name: demo\n")
    _final(run, 3)
    return run


def _one_paragraph(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli(["export", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\n" not in err.strip()
    return err


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_an_out_under_a_file_is_one_paragraph_naming_the_folder_errno_and_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    run = _fake_run(tmp_path / "run")
    (tmp_path / "a-file").write_text("x")  # (as root a mode cannot stop a write; a file in the way does)
    out = tmp_path / "a-file" / "sub" / "export"
    err = _one_paragraph(capsys, str(run), "--format", fmt, "--out", str(out))
    assert f"--out {out}: {tmp_path / 'a-file'} cannot be written ([Errno 20] Not a directory)" in err
    assert "choose an --out under a folder you can write" in err


def test_an_out_under_a_folder_this_user_cannot_write_is_one_paragraph(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _fake_run(tmp_path / "run")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes through any mode: the kernel's answer for another user, simulated
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real(p, mode))
    err = _one_paragraph(capsys, str(run), "--out", str(locked / "export"))
    assert f"{locked} cannot be written ([Errno 13] Permission denied)" in err
    assert not any(locked.iterdir())


def test_a_folder_that_cannot_be_made_at_write_time_is_one_paragraph(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What no check before the write can see (a read-only filesystem, where even root cannot write).
    run = _fake_run(tmp_path / "run")
    out = tmp_path / "ro" / "export"

    def read_only(self: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    err = _one_paragraph(capsys, str(run), "--out", str(out))
    assert f"--out {out}: {tmp_path / 'ro'} cannot be written ([Errno 30] Read-only file system)" in err
