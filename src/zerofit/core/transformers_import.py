"""`import transformers` for a process that loads a model, without two costs its run never uses.

**The model index, read once, not twice.** transformers (5.x) indexes its `models` package from the files
themselves: `import transformers` reads the `__all__` of every module under `transformers/models/` (~570
folders, ~1,100 files) to build its lazy namespace, and importing `transformers.models` (which every model or
tokenizer class load does) indexes the same folder again for the package's own namespace. Its
`create_import_structure_from_path` is cached, but keyed on the path as given (the folder the first time, the
package's `__init__.py` the second) and holding 128 folders, so the second index re-reads every file (~0.25-0.4
CPU-s on a 2-core machine). The function answers a file with its folder's index (its own first step) and
depends on nothing but the files, so its cache is keyed by folder before `transformers.models` is imported:
the second index is the first one's answer.

**scipy.optimize, when a loss needs it.** The modeling stack imports `transformers.loss.loss_utils`, which
imports every object-detection loss; each binds `scipy.optimize.linear_sum_assignment` at import where scipy
is installed, so loading any model imports scipy.optimize (~0.2-0.3 CPU-s) for the Hungarian matcher of
DETR-like models. The loss modules are imported here with `linear_sum_assignment` bound to a function that
imports scipy's on its first call and returns its answer; `scipy.optimize` itself is left unimported (and
imports as usual for anyone who asks for it).

Nothing else changes; where transformers has another layout, or those modules are loaded already, this is a
plain `import transformers` (tests/unit/test_lazy_imports.py holds the namespace and the matcher's answers
equal to transformers' own).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["import_transformers", "linear_sum_assignment"]

FOLDER_KEYED = "_zerofit_folder_keyed"  # marks the index function once it is keyed by folder
LOSSES = "transformers.loss.loss_utils"  # imports every loss module of transformers
SCIPY_OPTIMIZE = "scipy.optimize"


def import_transformers() -> ModuleType:
    """`import transformers`; its model index keyed by folder and its losses imported without
    scipy.optimize, each where not loaded yet (above)."""
    import transformers

    if "transformers.models" not in sys.modules:
        _key_index_by_folder()
    if LOSSES not in sys.modules and SCIPY_OPTIMIZE not in sys.modules:
        _import_losses_with_deferred_scipy()
    return transformers


def linear_sum_assignment(*args: Any, **kwargs: Any) -> Any:
    """`scipy.optimize.linear_sum_assignment(*args, **kwargs)`, scipy.optimize imported on the first call."""
    from scipy.optimize import linear_sum_assignment as solve

    return solve(*args, **kwargs)


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


def _import_losses_with_deferred_scipy() -> None:
    """Import `LOSSES` while `scipy.optimize` names a stand-in holding `linear_sum_assignment` (above), then
    take the stand-in out of `sys.modules`. (A `from scipy.optimize import NAME` finds a loaded module
    without importing `scipy`; a loss module that asked for any other name would fail to import, and the
    import is then retried with scipy itself.)"""
    stand_in = ModuleType(SCIPY_OPTIMIZE)
    stand_in.linear_sum_assignment = linear_sum_assignment  # type: ignore[attr-defined]
    sys.modules[SCIPY_OPTIMIZE] = stand_in
    try:
        importlib.import_module(LOSSES)
    except ImportError:
        _forget_modules("transformers.loss.")
    finally:
        if sys.modules.get(SCIPY_OPTIMIZE) is stand_in:
            del sys.modules[SCIPY_OPTIMIZE]


def _forget_modules(prefix: str) -> None:
    """Drop the modules under `prefix` from `sys.modules` (a failed import's partial ones), so that the next
    import of them runs afresh."""
    for name in [name for name in sys.modules if name.startswith(prefix)]:
        del sys.modules[name]
