"""`import transformers` with its model index read once per process, not twice.

transformers (5.x) indexes its `models` package from the files themselves: `import transformers` reads the
`__all__` of every module under `transformers/models/` (~570 folders, ~1,100 files) to build its lazy
namespace, and importing `transformers.models` (which every model or tokenizer class load does) indexes the
same folder again for the package's own lazy namespace. Its `create_import_structure_from_path` is cached,
but keyed on the path as given (the folder the first time, the package's `__init__.py` the second) and
holding 128 folders, so the second index re-reads every file: ~0.25-0.4 CPU-s of each launch on a 2-core
machine (`benchmarks/startup.py`).

The function answers a file with its folder's index (its own first step) and depends on nothing but the
files, so `import_transformers` keys its cache by folder before `transformers.models` is first imported:
the second index is then the first one's answer. Nothing else changes; where transformers has no such
function, or the models package is loaded already, this is a plain `import transformers`
(tests/unit/test_lazy_imports.py holds the index equal to transformers' own).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["import_transformers"]

FOLDER_KEYED = "_zerofit_folder_keyed"  # marks the index function once it is keyed by folder


def import_transformers() -> ModuleType:
    """`import transformers`; before its `models` package is imported, its index keyed by folder (above)."""
    import transformers

    if "transformers.models" not in sys.modules:
        _key_index_by_folder()
    return transformers


def _key_index_by_folder() -> None:
    """Route transformers' import-structure index through one cache key per folder (a `Path`, as
    `import transformers` itself passes the models folder)."""
    try:
        from transformers.utils import import_utils
    except ImportError:  # another layout of transformers: nothing to key
        return
    index = getattr(import_utils, "create_import_structure_from_path", None)
    if index is None or not hasattr(index, "cache_info") or getattr(index, FOLDER_KEYED, False):
        return

    @functools.wraps(index)
    def by_folder(module_path: Any) -> Any:
        if os.path.isfile(module_path):
            module_path = os.path.dirname(module_path)
        return index(Path(module_path))

    setattr(by_folder, FOLDER_KEYED, True)
    import_utils.create_import_structure_from_path = by_folder
