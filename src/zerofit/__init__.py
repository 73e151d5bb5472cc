"""zerofit: fine-tune 7B-class LLMs on small GPUs with one exact global batch, on DeepSpeed ZeRO or FSDP2.

`from zerofit import train, plan` (see `zerofit.api`) is the Python API. Both are imported on first use,
so `import zerofit` stays light (no torch, no transformers). The training loop is `zerofit.loop.train`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerofit.version import __version__

__all__ = ["RunResult", "__version__", "plan", "train"]

if TYPE_CHECKING:
    from zerofit.api import RunResult, plan, train


def __getattr__(name: str) -> Any:
    """`zerofit.train`, `zerofit.plan` and `zerofit.RunResult`: the API module, imported when first asked for."""
    if name in ("train", "plan", "RunResult"):
        from zerofit import api

        return getattr(api, name)
    raise AttributeError(f"module 'zerofit' has no attribute {name!r}")
