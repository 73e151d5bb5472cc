"""Checkpoints (atomic, verified by a manifest, loadable on another world size), resume, and the final export.

- `manifest`: what a complete checkpoint holds (files, sizes, checksums, config, batch plan) and `verify`.
- `checkpointer`: `Checkpointer` saves through the strategy and loads a verified checkpoint.
- `resume`: which run directory a launch writes and which checkpoint it resumes from (before any model load).
- `final_export`: `adapter/` or `model/` at the end of a run (reading a run back is `zerofit.trained`, writing an export `zerofit.export`).
"""

from zerofit.checkpoint.checkpointer import CHECKPOINTS, Checkpointer, complete_checkpoints
from zerofit.checkpoint.final_export import export_final, is_peft_model
from zerofit.checkpoint.manifest import MANIFEST, verify
from zerofit.checkpoint.resume import ResumePoint, checkpoint_record, finish_resume, settle_run_dir

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
