"""Optional libraries a process has not loaded stay out of sight of third-party code that would import them
only to look for their types.

peft imports bitsandbytes when it is imported and when it creates adapters (for its 8- and 4-bit layers),
and transformers' `save_pretrained` imports DeepSpeed (through accelerate's unwrapping, for its engine
type) whenever they are installed: bitsandbytes costs ~1 CPU-s (it imports torch's inductor), DeepSpeed
~1-2, in every process of a run that uses neither (tests/unit/test_lazy_imports.py). A process that has
not imported a library holds none of its objects, so such a check has nothing to find: `hidden_unless_loaded`
makes `import NAME` fail (ImportError, which these callers catch) and `importlib.util.find_spec(NAME)` answer
None while its block runs, and changes nothing where the library is already loaded.

The Hugging Face Hub's `kernels` package is never used by zerofit (every model load passes `use_kernels=False`,
`zerofit.levers.kernels.hub_kernels_off`; `train.kernels` is Liger's), yet bitsandbytes' CPU backend asks it
for a Hub kernel when bitsandbytes is imported, which fails without `trust_remote_code` and logs "Failed to
load CPU gemm_4bit_forward from kernels-community ...". `import_bitsandbytes` imports bitsandbytes with
`kernels` hidden and that one message dropped, for the import alone (tests/unit/test_lazy_imports.py).
transformers itself is left to see `kernels`: it caches that answer for the process, and a "not installed"
there would make every later `from_pretrained` with transformers' default `use_kernels=True` in the same
process (HF's Trainer, TRL, a notebook after `zerofit.train`) fail.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

__all__ = [
    "BNB_HUB_KERNEL_MESSAGE",
    "hidden_unless_loaded",
    "import_bitsandbytes",
]

HUB_KERNELS = "kernels"  # the Hugging Face Hub's kernel package (import name)
# The start of what bitsandbytes' CPU backend logs when its Hub kernel cannot be loaded.
BNB_HUB_KERNEL_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"
BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"  # the logger it is logged on (bitsandbytes' module name)


@contextmanager
def hidden_unless_loaded(name: str) -> Iterator[bool]:
    """Hide the top-level package `name` for the block unless it is imported already; yields whether it hid it.

    A `None` in `sys.modules` is Python's own "not importable" marker; it is removed afterwards, so that
    whatever needs the library later (a quantized model, an 8-bit optimizer, the DeepSpeed strategy)
    imports it as usual. Callers that cache an availability answer given during the block drop it.
    """
    if name in sys.modules:
        yield False
        return
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield True
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


class _DropHubKernelMessage(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(BNB_HUB_KERNEL_MESSAGE)


def import_bitsandbytes() -> ModuleType:
    """`import bitsandbytes`, without its CPU backend's Hub-kernel attempt or that attempt's message.

    zerofit asks for no Hub kernel, so bitsandbytes runs its own CPU code either way; with `kernels` hidden
    (even where transformers has imported it already) it does not fetch or trust-check one (and cannot pick one up from a user's trust allowlist), and the
    warning it logs instead is dropped by a filter on its logger for this import only. Any other record
    passes. Raises ImportError where bitsandbytes is not installed.
    """
    loaded = sys.modules.get("bitsandbytes")  # None there: hidden, and the import below raises ImportError
    if loaded is not None:
        return loaded
    drop, logger = _DropHubKernelMessage(), logging.getLogger(BNB_CPU_LOGGER)
    logger.addFilter(drop)
    try:
        with _hidden_even_if_loaded(HUB_KERNELS):
            return importlib.import_module("bitsandbytes")
    finally:
        logger.removeFilter(drop)


@contextmanager
def _hidden_even_if_loaded(name: str) -> Iterator[None]:
    """Hide the package `name` and its submodules for the block, whether imported or not, then put back
    exactly what was there. For `import_bitsandbytes`: transformers' modeling stack imports `kernels` where
    it is installed, usually before a quantized load imports bitsandbytes, and bitsandbytes would then fetch
    its CPU kernel from the Hub cache."""
    saved = {key: mod for key, mod in sys.modules.items() if key == name or key.startswith(f"{name}.")}
    for key in saved:
        del sys.modules[key]
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(name, ...) is None:
            del sys.modules[name]
        sys.modules.update(saved)
