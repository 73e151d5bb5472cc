"""Checkpoints (atomic, verified by a manifest, loadable on another world size), resume, and the final export.

- `manifest`: what a complete checkpoint holds (files, sizes, checksums, config, batch plan) and `verify`.
- `checkpointer`: `Checkpointer` saves through the strategy and loads a verified checkpoint.
- `resume`: which run directory a launch writes and which checkpoint it resumes from (before any model load).
- `final_export`: `adapter/` or `model/` at the end of a run (reading a run back is `zerofit.trained`, writing an export `zerofit.export`).

The names below are imported from their module when first asked for: `checkpointer` and `final_export`
import torch, and `zerofit plan` (through `rundir`, the run directory's name) must not pay for them.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name -> the submodule that defines it.
_HOMES = {
    "CHECKPOINTS": "checkpointer",
    "Checkpointer": "checkpointer",
    "complete_checkpoints": "checkpointer",
    "export_final": "final_export",
    "is_peft_model": "final_export",
    "MANIFEST": "manifest",
    "verify": "manifest",
    "ResumePoint": "resume",
    "checkpoint_record": "resume",
    "finish_resume": "resume",
    "settle_run_dir": "resume",
}

__all__ = [
    "CHECKPOINTS",
    "MANIFEST",
    "Checkpointer",
    "ResumePoint",
    "checkpoint_record",
    "complete_checkpoints",
    "export_final",
    "finish_resume",
    "is_peft_model",
    "settle_run_dir",
    "verify",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its submodule when first asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zerofit.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zerofit.checkpoint.{home}"), name)
