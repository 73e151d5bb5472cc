"""Which weights `zerofit export` / `generate` read from a run directory, and what they say when there are none.

(The readers themselves run on real ZeRO-3, FSDP2 and single-process checkpoints in
tests/distributed/test_multinode_export.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerofit.checkpoint.manifest import MANIFEST
from zerofit.errors import ConfigError
from zerofit.export import find_weights, read_checkpoint, read_run_config


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
