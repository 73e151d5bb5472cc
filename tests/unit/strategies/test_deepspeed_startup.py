"""A ZeRO launch does not pay at start-up for DeepSpeed kernels it never runs.

DeepSpeed 0.19's Muon module, imported by every ZeRO 1-3 reduction, decorates its kernels with
`torch.compile` at import, which imports inductor's compiler (`torch._inductor.compile_fx` and its code
generators: ~160 modules, ~0.7 CPU-s a rank of a one-process ZeRO-2 run on a 2-core CPU machine).
`compile_deepspeed_kernels_on_first_call` defers each `torch.compile` to the kernel's first call.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from zerofit.strategies.deepspeed import compile_deepspeed_kernels_on_first_call

MUON = "deepspeed.runtime.zero.muon.original_muon"

# A fresh interpreter imports DeepSpeed's Muon kernels, with or without zerofit's deferral first, and says
# whether inductor's compiler came with them.
IMPORT_MUON = f"""
import sys
import deepspeed
if sys.argv[1] == "deferred":
    from zerofit.strategies.deepspeed import compile_deepspeed_kernels_on_first_call
    compile_deepspeed_kernels_on_first_call()
import {MUON}
print("torch._inductor.compile_fx" in sys.modules)
"""


@pytest.mark.parametrize(("mode", "inductor"), [("as-shipped", "True"), ("deferred", "False")])
def test_importing_deepspeeds_muon_kernels_loads_inductor_only_without_the_deferral(
    mode: str, inductor: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_MUON, mode], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == inductor


def test_a_deferred_kernel_is_compiled_once_by_torch_compile_on_its_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deepspeed.runtime import compiler

    monkeypatch.setattr(compiler, "compile", compiler.compile)  # put DeepSpeed's decorator back afterwards
    monkeypatch.delitem(sys.modules, MUON, raising=False)  # as in a rank before its first reduction
    compiled: list[Callable[..., Any]] = []

    def fake_compile(func: Callable[..., Any]) -> Callable[..., Any]:
        compiled.append(func)
        return lambda *args: ("compiled", func(*args))

    monkeypatch.setattr(torch, "compile", fake_compile)
    compile_deepspeed_kernels_on_first_call()

    def kernel(x: int) -> int:
        """DeepSpeed's kernel."""
        return x + 1

    decorated = compiler.compile()(kernel)
    assert compiled == [] and decorated.__doc__ == kernel.__doc__  # nothing compiled at decoration
    assert decorated(1) == ("compiled", 2) and decorated(2) == ("compiled", 3)
    assert compiled == [kernel]  # compiled once, by torch.compile, on the first call


def test_the_deferral_leaves_already_imported_kernels_and_the_decorator_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deepspeed.runtime import compiler

    shipped = compiler.compile
    monkeypatch.setattr(compiler, "compile", shipped)
    monkeypatch.setitem(sys.modules, MUON, sys.modules.get(MUON, object()))  # already decorated
    compile_deepspeed_kernels_on_first_call()
    assert compiler.compile is shipped
