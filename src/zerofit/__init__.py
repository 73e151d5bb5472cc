"""zerofit: fine-tune 7B-class LLMs on small GPUs with one exact global batch, on DeepSpeed ZeRO or FSDP2.

`from zerofit import train, plan` (see `zerofit.api`) is the Python API. Both are imported on first use,
so `import zerofit` stays light (no torch, no transformers). The training loop is `zerofit.loop.train`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from zerofit.version import __version__

__all__ = ["RunResult", "__version__", "plan", "train"]

if TYPE_CHECKING:
    from zerofit.api import RunResult, plan, train


# Documented import paths of modules that moved into their package (docs/contracts.md's batch API was
# `from zerofit.batching import solve_batch, BatchPlan, BatchConfigError`): the old name is the new module.
MOVED_MODULES = {"zerofit.batching": "zerofit.config.batching"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import a `MOVED_MODULES` old name as the module it now is (one module object under both names)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        """A spec for an old name, loaded by this finder; None for every other module."""
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec: Any) -> Any:
        """The moved module itself, imported under its new name."""
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module was executed when its new name was imported."""


sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    """`zerofit.train`, `zerofit.plan` and `zerofit.RunResult`: the API module, imported when first asked for."""
    if name in ("train", "plan", "RunResult"):
        from zerofit import api

        return getattr(api, name)
    raise AttributeError(f"module 'zerofit' has no attribute {name!r}")
