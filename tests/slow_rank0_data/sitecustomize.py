"""Make rank 0 slow to load its data, as a long tokenization would (tests/distributed/test_failures.py).

A test fault, kept out of zerofit: a launch that puts this folder first on PYTHONPATH (absolute) and sets
`DELAY_ENV` to a number of seconds gets its rank 0 sleeping that long before each data load of
`zerofit.recipe.assembly._rank0_first` (the training data's, then the held-out data's); the other ranks
load as they always do, so they wait for rank 0 in the real code. Without `DELAY_ENV` this file does nothing
but hand over to the next `sitecustomize` on the path (tests/avx2_cpu's, say), which it would otherwise hide.

Python imports `sitecustomize` at start-up in every process (a launch's ranks inherit the environment). This
one imports neither torch nor zerofit: it waits for `zerofit.recipe.assembly`'s import (as tests/avx2_cpu
waits for torch's), then wraps its `_rank0_first`; a rename there fails the launch here (AttributeError)
instead of leaving the fault out unnoticed.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

DELAY_ENV = "ZEROFIT_FAULT_DELAY_RANK0_DATA_S"  # seconds rank 0 sleeps before each of its data loads
PATCHED = "zerofit.recipe.assembly"


def _delay_rank0_loads(assembly: ModuleType) -> None:
    """`_rank0_first` of `assembly`, rank 0 sleeping `DELAY_ENV` seconds first (the module calls it by name)."""
    delay_s = float(os.environ[DELAY_ENV])
    rank0_first = assembly._rank0_first

    @functools.wraps(rank0_first)
    def late_on_rank0(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        if strategy.rank == 0:
            time.sleep(delay_s)
        return rank0_first(strategy, *args, **kwargs)

    assembly._rank0_first = late_on_rank0


class _AfterAssembly(importlib.abc.MetaPathFinder):
    """Finds `PATCHED` once, through the other finders, and runs `_delay_rank0_loads` after its import."""

    def find_spec(
        self, name: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != PATCHED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            _delay_rank0_loads(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def _run_next_sitecustomize() -> None:
    """The `sitecustomize` that Python would have imported without this folder first on the path, if any."""
    here = Path(__file__).resolve().parent
    rest = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":  # started by Python, not imported by a test for `DELAY_ENV`
    if os.environ.get(DELAY_ENV):
        sys.meta_path.insert(0, _AfterAssembly())
    _run_next_sitecustomize()
