"""Run the suite, or any command, as a CPU without bfloat16 kernels computes (AVX2 only, as CI's machines were).

bf16 arithmetic differs between CPUs with AVX512-BF16 / AMX, AVX512 and AVX2 kernels (docs/contracts.md,
"Shown outputs"). To test the other path on one machine, put this folder first on PYTHONPATH with ATEN's
capability capped at AVX2:

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$PWD/tests/avx2_cpu make test

(an absolute path: the suite runs commands from scratch folders)

Python imports `sitecustomize` at start-up in every process (the suite's launched ranks included, which
inherit the environment). This one waits for torch's import, then turns oneDNN off in that process (torch's
bf16 matmuls then take its own reference kernels, as on a CPU without AVX512), so that
`zerofit.core.precision.cpu_computes_bf16` answers False, as it does there. Measured on an AVX512-BF16
AMD EPYC (torch 2.13): the multi-node guide's bf16 losses then equal, to the 4th decimal, what an AVX2-only
EPYC printed (step 1: 4.8519 against 4.8520 without this), which neither setting alone reproduced.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType


def _without_bf16_kernels(torch: ModuleType) -> None:
    """oneDNN off in this process (zerofit's `cpu_computes_bf16` then answers False, as on an AVX2 CPU)."""
    torch.backends.mkldnn.enabled = False


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds torch once, through the other finders, and runs `_without_bf16_kernels` after its import."""

    def find_spec(
        self, name: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            _without_bf16_kernels(module)

        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterTorch())
