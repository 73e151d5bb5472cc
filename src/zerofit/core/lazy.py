"""Optional libraries a process has not loaded stay out of sight of third-party code that would import them
only to look for their types.

peft imports bitsandbytes when it is imported and when it creates adapters (for its 8- and 4-bit layers),
and transformers' `save_pretrained` imports DeepSpeed (through accelerate's unwrapping, for its engine
type) whenever they are installed: bitsandbytes costs ~1 CPU-s (it imports torch's inductor), DeepSpeed
~1-2, in every process of a run that uses neither (tests/unit/test_lazy_imports.py). A process that has
not imported a library holds none of its objects, so such a check has nothing to find: `hidden_unless_loaded`
makes `import NAME` fail (ImportError, which these callers catch) and `importlib.util.find_spec(NAME)` answer
None while its block runs, and changes nothing where the library is already loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["hidden_unless_loaded"]


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
