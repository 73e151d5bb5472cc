"""zerofit: fine-tune 7B-class LLMs on small GPUs with one exact global batch, on DeepSpeed ZeRO or FSDP2.

`from zerofit import train, plan` (see `zerofit.api`) is the Python API. Both are imported on first use,
so `import zerofit` stays light (no torch, no transformers).
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from zerofit.version import __version__

__all__ = ["RunResult", "__version__", "plan", "train"]

if TYPE_CHECKING:
    from zerofit.api import RunResult, plan, train


class _Package(types.ModuleType):
    """The `zerofit` package, whose `train` attribute is always the API function.

    The training loop lives in the submodule `zerofit.train`, and importing a submodule binds it as an
    attribute of its package, which would replace the function after the first run. This property keeps
    the function there: the loop module is imported by name (`from zerofit.train import train_loop`),
    never as the attribute `zerofit.train`.
    """

    @property
    def train(self) -> Any:
        from zerofit.api import train

        return train

    @train.setter
    def train(self, submodule: Any) -> None:
        del submodule  # the import system binding `zerofit.train` (the loop module): it stays in sys.modules


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """`zerofit.plan` and `zerofit.RunResult`: the API module, imported when first asked for."""
    if name in ("plan", "RunResult"):
        from zerofit import api

        return getattr(api, name)
    raise AttributeError(f"module 'zerofit' has no attribute {name!r}")
