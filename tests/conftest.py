"""Shared test setup: offline, CPU, one JIT cache for DeepSpeed ops and one tiny-model cache for all tests."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Set before anything imports deepspeed/transformers/wandb, and inherited by every launched subprocess.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("ZEROFIT_CACHE", str(REPO_ROOT / ".cache" / "zerofit"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")
# Never let a developer's real W&B key turn a test run online.
os.environ.pop("WANDB_API_KEY", None)
