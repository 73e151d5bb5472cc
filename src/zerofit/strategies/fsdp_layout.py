"""Where an FSDP2 checkpoint keeps its state inside step-N/: names only, no torch.distributed import.

Written by `zerofit.strategies.fsdp` and read back by `zerofit.trained.checkpoints` and the resume check: those
readers run in processes of every engine (a one-process run's teacher, `zerofit export`), which need these
names without importing torch.distributed.checkpoint (~0.1 CPU-s) for a checkpoint that is not FSDP's.
"""

from __future__ import annotations

DCP_DIR = "dcp"  # the torch.distributed.checkpoint folder holding {DCP_MODEL_KEY: ..., DCP_OPTIM_KEY: ...}
DCP_MODEL_KEY, DCP_OPTIM_KEY = "model", "optim"
EXTRA_FILE = "extra.pt"  # scheduler + client state (identical on every rank; rank 0 writes it)
