"""Shared test setup: offline, CPU, the user's caches (what `make demo` built is reused), cores shared by workers."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _set_cache_defaults() -> None:
    """Export DeepSpeed's JIT folder as every launch does (`use_cache_defaults`), for in-process DeepSpeed too."""
    from zerofit.core.cache_dirs import cache_root, use_cache_defaults  # (imports no torch)

    os.environ.setdefault("ZEROFIT_CACHE", str(cache_root()))  # explicit for every process a test starts
    use_cache_defaults()


# Set before anything imports deepspeed/transformers/wandb, and inherited by every launched subprocess.
# The caches are the user's own ($ZEROFIT_CACHE, default ~/.cache/zerofit; zerofit.core.cache_dirs), where
# `make demo` and a hand-typed launch put them: what the demo built (DeepSpeed's JIT-compiled CPU ops, ~135
# CPU-s on 2 cores; the built-in models; the converted SmolLM2) the suite reuses instead of building again.
# Every entry is checked before use; a test about an empty cache makes its own (tmp_path).
_set_cache_defaults()
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")
# Progress lines (`zerofit.core.progress`) come after 10 s without output, so whether one shows up depends on
# the machine's load: the suite's commands print none (an hour), and the tests of progress set their own.
os.environ.setdefault("ZEROFIT_PROGRESS_EVERY_S", "3600")
# The virtualenv's tools first, as in an activated venv, for every test and every process it launches: the
# venv's `ninja` (a torch dependency) and a system `ninja` of another version each find the other's build
# log stale, so DeepSpeed's JIT ops (deepspeed_shm_comm) were rebuilt (~40 s of both cores) whenever a test
# launched with the other one on PATH (the README test runs commands as a user with the venv active would).
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# Never let a developer's real W&B key turn a test run online.
os.environ.pop("WANDB_API_KEY", None)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (`make test` runs 2 workers), each worker's torch gets its share of the cores.

    torch starts a thread per core; two workers that each do so put twice as many OpenMP threads as cores
    on the machine, and those threads then wait for each other at every op (several times slower on 2
    cores). Set before anything imports torch, so it also holds for what a test starts (README commands,
    the launches of tests/launch_helpers.py, which give a one-process launch its share of this one).
    A user's own OMP_NUM_THREADS wins.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // workers)))


_share_cores_between_workers()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test`'s serial phase collects only the test files whose text says `mark.serial` (the Makefile's
    SERIAL_FILES): a test marked serial some other way (a marker alias, a parametrize mark built elsewhere)
    would silently run in neither phase, so it is refused at collection."""
    for item in items:
        if item.get_closest_marker("serial") and "mark.serial" not in item.path.read_text():
            raise pytest.UsageError(
                f"{item.nodeid} is marked serial but its file never says `mark.serial`: write "
                "`@pytest.mark.serial` in it, so that `make test`'s serial phase (SERIAL_FILES) finds it"
            )


@pytest.fixture(autouse=True, scope="module")
def _launches_listed(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test module's tests: every launch it started (tests/launch_helpers.py) is a row of its
    docstring's `launch  launcher ...` table, with the launcher that ran it, so each launch module's list of
    the combinations it covers, and which launcher runs each, stays what it really runs."""
    yield
    helpers = sys.modules.get("launch_helpers")
    if helpers is None:  # the module launched nothing
        return
    module_file = str(request.path)
    missing = helpers.unlisted(module_file, request.module.__doc__ or "")
    assert not missing, (
        f"{request.path.name} started launches its docstring's `launch  launcher ...` table does not list "
        f"with their launcher: {', '.join(missing)}; add a row for each (id or fnmatch pattern, launcher, "
        "what it covers)"
    )
