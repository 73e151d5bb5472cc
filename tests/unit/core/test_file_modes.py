"""Files zerofit writes take the umask's mode, like any file `open()` creates (safetensors' 0600 included)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerofit.core.file_modes import follow_umask, umask_file_mode


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_every_file_under_a_folder_takes_the_umask_mode_and_links_are_left_alone(
    tmp_path: Path, umask_027: None
) -> None:
    assert umask_file_mode() == 0o640
    folder = tmp_path / "export"
    (folder / "sub").mkdir(parents=True)
    weights, nested, target = folder / "model.safetensors", folder / "sub" / "a.json", tmp_path / "elsewhere"
    for file in (weights, nested, target):
        file.write_text("x")
    weights.chmod(0o600)  # as safetensors writes it
    nested.chmod(0o666)
    target.chmod(0o600)
    (folder / "link").symlink_to(target)
    follow_umask(folder)
    assert (weights.stat().st_mode & 0o777, nested.stat().st_mode & 0o777) == (0o640, 0o640)
    assert target.stat().st_mode & 0o777 == 0o600  # the link's target is not the export's file
    single = tmp_path / "table.safetensors"
    single.write_text("x")
    single.chmod(0o600)
    follow_umask(single)
    assert single.stat().st_mode & 0o777 == 0o640
