"""The planner takes every element size from `zerofit.core.precision` (the one precision table): no dtype -> bytes
mapping is spelled again in `planner/`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerofit.core.precision import dtype_bytes
from zerofit.planner.scenario import Scenario, compute_profile
from zerofit.planner.state import dtype_label

PLANNER = Path(__file__).resolve().parents[3] / "src" / "zerofit" / "planner"

# The spellings the planner used before it asked precision.py: `4 if x == "fp32" else 2`,
# `dtype_bytes(half) if half else 4`, `{"bf16": 2, ...}`, `{4: "fp32", 2: ...}`.
RESTATED = re.compile(
    r"""\d if [\w.]+ == "fp32" else \d|dtype_bytes\([\w.]+\) if [\w.]+ else \d|["'](?:bf16|fp16|fp32)["']: \d"""
    r"""|\{\d: ["']fp32["']"""
)


def test_no_dtype_size_is_restated_in_the_planner() -> None:
    found = [
        f"{path.relative_to(PLANNER)}:{n}: {line.strip()}"
        for path in sorted(PLANNER.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if RESTATED.search(line)
    ]
    assert not found, f"element sizes restated instead of zerofit.core.precision.dtype_bytes: {found}"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_compute_bytes_come_from_the_precision_table(precision: str) -> None:
    prof = compute_profile(Scenario(model="tiny-llama", seq_len=8, micro_batch_size=1, precision=precision))
    assert prof.half_bytes == dtype_bytes(prof.half or "fp32") == dtype_bytes(precision)
    assert dtype_label(dtype_bytes(precision), prof.half) == precision
