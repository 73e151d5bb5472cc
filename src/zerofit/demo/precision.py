"""The demo's precision on this machine: `make demo` asks here before its launch.

`configs/demo-smollm2.yaml` trains in bf16, the precision of the GPUs it is written for. A CPU without
bfloat16 kernels (`cpu_computes_bf16`: an AVX2-only x86 CPU, say) still computes bf16, through torch's
reference path, ~20x slower per step than fp32: 24 steps took ~25 minutes on 2 such cores instead of ~2. There
the demo runs in fp32 and says so; on a GPU, or a CPU with the kernels, it runs the config as written.

`python -m zerofit.demo.precision ACCELERATOR` prints the dotted overrides for the demo's command
line (nothing, or `train.precision=fp32`) on stdout and, when there are any, the reason on stderr.
"""

from __future__ import annotations

import sys

from zerofit.core.precision import cpu_computes_bf16

__all__ = ["demo_precision_overrides", "main"]

FP32_REASON = (
    "zerofit demo: train.precision=fp32 (the config says bf16): this CPU has no bfloat16 kernels "
    "(oneDNN: no AVX512 or AMX), where a bf16 step runs ~20x slower than an fp32 one"
)


def demo_precision_overrides(accelerator: str) -> list[str]:
    """The overrides the demo runs with on `accelerator` (DeepSpeed's: `cpu` or `cuda`): fp32 on a CPU
    without bfloat16 kernels, none elsewhere."""
    if accelerator == "cpu" and not cpu_computes_bf16():
        return ["train.precision=fp32"]
    return []


def main(argv: list[str] | None = None) -> int:
    """Print the demo's precision overrides for the accelerator named on the command line."""
    args = sys.argv[1:] if argv is None else argv
    accelerator = args[0] if args else "cpu"
    overrides = demo_precision_overrides(accelerator)
    if overrides:
        print(FP32_REASON, file=sys.stderr)
    print(" ".join(overrides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
