"""A run's trained weights out of zerofit: read back from any engine's checkpoint or final export, rebuilt,
merged and written as folders that peft and transformers load, or as GGUF for llama.cpp / Ollama / LM Studio
(`zerofit export`, `zerofit generate`)."""

from zerofit.export.checkpoints import WeightsSource, find_weights, read_checkpoint
from zerofit.export.folder import EXPORT_INFO, ExportResult, export_run
from zerofit.export.gguf_export import GGUFExportResult, export_gguf
from zerofit.export.trained import RunConfig, TrainedModel, build_trained, load_trained, read_run_config

__all__ = [
    "EXPORT_INFO",
    "ExportResult",
    "GGUFExportResult",
    "RunConfig",
    "TrainedModel",
    "WeightsSource",
    "build_trained",
    "export_gguf",
    "export_run",
    "find_weights",
    "load_trained",
    "read_checkpoint",
    "read_run_config",
]
