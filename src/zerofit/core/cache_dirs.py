"""Where zerofit keeps what it builds once per machine, the one spelling of each folder.

One root, `$ZEROFIT_CACHE` (default `~/.cache/zerofit`), holds the built-in models, the tokenization and
reference caches and the planner's counts; DeepSpeed's JIT-compiled ops (torch's `TORCH_EXTENSIONS_DIR`)
default to `<root>/torch_extensions`. The default is the same whoever launches (`make demo`, a hand-typed
`deepspeed ...`, `zerofit.train`), so a first hand-run launch after the demo finds the compiled ops and
the built model instead of paying for them again, and one variable moves every cache. The launch sets the
extensions default (`use_cache_defaults`) before DeepSpeed can compile anything; an exported
`TORCH_EXTENSIONS_DIR` is kept.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EXTENSIONS_ENV", "cache_root", "extensions_dir", "use_cache_defaults"]

# torch.utils.cpp_extension's variable: where DeepSpeed's JIT builds (CPU Adam, the CPU allreduce) go.
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"


def cache_root() -> Path:
    """zerofit's cache root: `$ZEROFIT_CACHE`, default `~/.cache/zerofit`."""
    return Path(os.environ.get("ZEROFIT_CACHE") or Path.home() / ".cache" / "zerofit").expanduser()


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-compiled ops are cached: `$TORCH_EXTENSIONS_DIR`, default under the root."""
    return Path(os.environ.get(EXTENSIONS_ENV) or cache_root() / "torch_extensions").expanduser()


def use_cache_defaults() -> Path:
    """Export the extensions folder when unset (before DeepSpeed compiles an op); returns it.

    torch reads `TORCH_EXTENSIONS_DIR` when it builds, so the launch sets it early, once, for every rank.
    """
    folder = extensions_dir()
    os.environ[EXTENSIONS_ENV] = str(folder)
    return folder
