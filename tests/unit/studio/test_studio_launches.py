"""A launch's run folder gets its validated config first, created exclusively: a second launch into the same
folder (another tab a moment later) is refused in one paragraph, and the config written names that folder
and resumes in it (`checkpoint.resume=auto`), so the launcher writes there and nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from zerofit.core.errors import LaunchError
from zerofit.studio.launches import write_run_config


def test_the_run_config_is_written_once_into_its_folder(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "demo"
    config = {"run_name": "other", "output_dir": "runs", "checkpoint": {"keep_last": 2}, "seed": 7}
    written = yaml.safe_load(write_run_config(run, config).read_text())
    assert written["run_name"] == "demo" and written["output_dir"] == str(run.parent)
    assert written["checkpoint"] == {"keep_last": 2, "resume": "auto"} and written["seed"] == 7
    with pytest.raises(LaunchError, match=r"was taken by another launch .*two runs never write one folder"):
        write_run_config(run, config)
