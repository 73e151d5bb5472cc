"""A run's trained weights written out of zerofit: merged and written as folders that peft and transformers
load, or as GGUF for llama.cpp / Ollama / LM Studio (`zerofit export`). Reading a run back (its weights, the
model as trained) is `zerofit.trained`'s."""

from zerofit.export.folder import EXPORT_INFO, ExportResult, export_run
from zerofit.export.gguf_export import GGUFExportResult, export_gguf

__all__ = [
    "EXPORT_INFO",
    "ExportResult",
    "GGUFExportResult",
    "export_gguf",
    "export_run",
]
