#!/usr/bin/env python
"""Fine-tune entry point (docs/contracts.md, "Entry point"); runs under `deepspeed`, `torchrun` and `python`.

    deepspeed --num_gpus N launchers/launch_finetune.py --config configs/demo.yaml [key=value ...]
    torchrun --nproc_per_node N launchers/launch_finetune.py --config CFG distributed.strategy=fsdp
    python launchers/launch_finetune.py --config CFG distributed.strategy=single

Everything happens in `zerofit.recipe.run.main`: parse -> resolve -> assemble -> resume -> print plan -> train.
"""

import os
import sys
from pathlib import Path

try:
    from zerofit.core.progress import progress  # no torch: it reports while torch loads
except ModuleNotFoundError:  # a checkout without `pip install -e .`: use its src/ directly
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from zerofit.core.progress import progress

# Loading torch takes seconds, tens on a busy machine: rank 0 says so when it is long (zerofit.core.progress).
with progress("starting: importing torch", enabled=os.environ.get("RANK", "0") == "0"):
    from zerofit.recipe.run import main

if __name__ == "__main__":
    code = main()
    # Every result is written and closed by now. Leave without interpreter finalization: gloo worker
    # threads torn down during it can abort a finished rank (SIGABRT, "terminate called without an active
    # exception"), turning a successful run into a failed launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
