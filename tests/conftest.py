"""Shared test setup: offline, CPU, one JIT cache for DeepSpeed ops and one tiny-model cache for all tests."""

from __future__ import annotations

import os
import sys
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
# The virtualenv's tools first, as in an activated venv, for every test and every process it launches: the
# venv's `ninja` (a torch dependency) and a system `ninja` of another version each find the other's build
# log stale, so DeepSpeed's JIT ops (deepspeed_shm_comm) were rebuilt (~40 s of both cores) whenever a test
# launched with the other one on PATH (the README test runs commands as a user with the venv active would).
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# Never let a developer's real W&B key turn a test run online.
os.environ.pop("WANDB_API_KEY", None)
