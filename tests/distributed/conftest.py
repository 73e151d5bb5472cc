"""Fixtures shared by the launch modules of tests/distributed."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_helpers import deepspeed_shm_segments


@pytest.fixture(scope="module")
def shm_before() -> set[Path]:
    """This worker's DeepSpeed CPU allreduce segments in /dev/shm before the requesting module's launches."""
    return deepspeed_shm_segments()
