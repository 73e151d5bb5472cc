"""tests/launch_helpers.py's `api` launches: `zerofit.train` in the test's own process, beside subprocess
launches of the same `run_launches` call, with the output captured and the worker's state left as it was.

    launch       launcher   what
    in-process   api        a tiny run in this process
    subprocess   python     the same run launched: the same losses and summary line
    refused      api        a misspelt key: exit 2 and the paragraph, in this process
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from config_helpers import DEMO_DATA
from launch_helpers import (
    Launch,
    _python_path,
    _warnings_printed,
    _worker_state_kept,
    run_launches,
    write_config,
)

TINY = ("distributed.strategy=single", "batch.micro_batch_size=4")


def _worker_state(warning_filters: bool = True) -> dict[str, Any]:
    """What a training in this process could change and other tests in it would notice (`warning_filters`:
    also Python's warning filters, which a module imported for the first time may add to)."""
    state = {
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch_rng": torch.get_rng_state().tolist(),
        "random": random.getstate(),
        "numpy": repr(np.random.get_state()),
        "environ": dict(os.environ),
        "handlers": [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)],
        "process_group": dist.is_available() and dist.is_initialized(),
        "showwarning": warnings.showwarning,
    }
    return {**state, "warning_filters": list(warnings.filters)} if warning_filters else state


def test_the_worker_state_is_restored_after_an_in_process_run() -> None:
    before = _worker_state(warning_filters=False)
    with _worker_state_kept({"OMP_NUM_THREADS": "1", "ZEROFIT_TEST_ONLY": "1"}):
        assert os.environ["ZEROFIT_TEST_ONLY"] == "1" and torch.get_num_threads() == 1
        os.environ["RANK"] = "0"  # what zerofit's launch_env sets for a one-process run
        torch.manual_seed(123)
        random.seed(1)
        np.random.seed(1)
        torch.set_default_dtype(torch.float64)
        signal.signal(signal.SIGTERM, lambda *_: None)
    assert _worker_state(warning_filters=False) == before


def test_an_in_process_run_imports_from_its_pythonpath_and_forgets_it_after(tmp_path: Path) -> None:
    """A launch's PYTHONPATH (e.g. the folder of a user's reward module) is on `sys.path` for the run only."""
    import importlib

    (tmp_path / "zerofit_test_only_module.py").write_text("VALUE = 7\n")
    path = list(sys.path)
    with _python_path(os.pathsep.join([str(tmp_path), *sys.path[:1]])):
        assert importlib.import_module("zerofit_test_only_module").VALUE == 7
    assert sys.path == path and "zerofit_test_only_module" not in sys.modules


def test_an_in_process_runs_warnings_go_to_its_stderr(recwarn: pytest.WarningsRecorder) -> None:
    """As a launched run's: printed once per place (pytest records none), deprecations of libraries not shown."""
    before = _worker_state()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), _warnings_printed():
        for _ in range(2):
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
    assert (
        err.getvalue().count("UserWarning: a library's warning") == 1 and "deprecation" not in err.getvalue()
    )
    assert not recwarn.list
    assert _worker_state() == before


@pytest.mark.slow
def test_an_api_launch_trains_in_this_process_beside_a_subprocess_launch(tmp_path: Path) -> None:
    """One `run_launches` call: the same tiny run as an `api` launch and a `python` launch (the same losses,
    bit for bit, and the same summary printed), plus an `api` launch with a user error (exit 2 with the
    paragraph and the traceback on stderr). Afterwards this process is as it was: no process group, the
    same default dtype, RNG states, thread count and environment."""
    config = write_config(
        tmp_path / "tiny.yaml",
        {
            "seed": 3,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 4},
            "train": {"max_steps": 2, "precision": "fp32"},
            "lora": {"enabled": False},
            "data": {"path": DEMO_DATA, "max_seq_len": 64},
            "checkpoint": {"save_final": False},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    before = _worker_state()
    launches = [
        Launch("in-process", "api", TINY),
        Launch("subprocess", "python", TINY),
        Launch("refused", "api", (*TINY, "train.max_stpes=2")),
    ]
    runs = run_launches(launches, config, tmp_path / "runs")
    assert _worker_state() == before
    inproc, sub = runs["in-process"].check(), runs["subprocess"].check()
    assert inproc.series("loss") == sub.series("loss") and len(inproc.metrics) == 2
    assert "zerofit plan" in inproc.stdout and "done: 2 steps" in inproc.stdout
    done = [[line for line in run.stdout.splitlines() if line.startswith("done:")] for run in (inproc, sub)]
    assert done[0] == done[1] and len(done[0]) == 1  # the same summary line, captured from this process
    assert (tmp_path / "runs" / "_logs" / "in-process.out").read_text() == inproc.stdout
    refused = runs["refused"]
    assert refused.returncode == 2
    assert "unknown key 'train.max_stpes'" in refused.stderr and "Traceback" in refused.stderr
    assert not refused.run_dir.exists()
