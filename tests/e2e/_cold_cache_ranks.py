"""Run by `test_first_contact.py` under torchrun: what every rank of a launch does with the built-in model.

The libraries are imported and the process group initialized (gloo) first, as in a run, where zerofit's
strategy initializes it and then holds the ranks together (collectives) until the model is resolved; a
barrier stands for those collectives, so the ranks reach the build at the same moment. Then every rank
resolves `tiny-llama` (building it on a cold cache) and loads it as a run does, and prints one line
`RANK <r> OK <folder>`. `ZEROFIT_TEST_LATE_RANK=<r>` makes rank r start 2 s late, so the other rank
builds first (without it, the ranks race).
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from zerofit.models.tiny import ensure_tiny_llama


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    if os.environ.get("ZEROFIT_TEST_LATE_RANK") == os.environ["RANK"]:
        time.sleep(2.0)
    folder = ensure_tiny_llama(0)
    AutoTokenizer.from_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(folder)
    dist.barrier()
    # One write of the whole line: under PYTHONUNBUFFERED, print() writes the text and its newline apart,
    # and the two ranks' lines can interleave on the shared pipe.
    sys.stdout.write(f"RANK {os.environ['RANK']} OK {folder}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
