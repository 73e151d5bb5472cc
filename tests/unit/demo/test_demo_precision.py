"""The demo's precision on this machine (`zerofit.demo.precision`): the config's bf16 on a GPU or a CPU
with bfloat16 kernels, fp32 (said on stderr) on a CPU without them, where bf16 runs ~20x slower; and
`make demo` passes it before the user's own overrides, so `DEMO_ARGS=train.precision=...` still wins."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from zerofit.core.precision import cpu_computes_bf16
from zerofit.demo import precision as demo_precision

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("accelerator", "kernels", "expected"),
    [
        ("cpu", False, ["train.precision=fp32"]),
        ("cpu", True, []),
        # A GPU computes bf16 (or the launch refuses it): the CPU's kernels don't matter.
        ("cuda", False, []),
    ],
)
def test_the_rule(
    monkeypatch: pytest.MonkeyPatch, accelerator: str, kernels: bool, expected: list[str]
) -> None:
    monkeypatch.setattr(demo_precision, "cpu_computes_bf16", lambda: kernels)
    assert demo_precision.demo_precision_overrides(accelerator) == expected


def test_the_command_prints_the_overrides_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo_precision, "cpu_computes_bf16", lambda: False)
    assert demo_precision.main(["cpu"]) == 0
    out, err = capsys.readouterr()
    assert out == "train.precision=fp32\n"
    assert "train.precision=fp32 (the config says bf16)" in err and "bfloat16 kernels" in err
    monkeypatch.setattr(demo_precision, "cpu_computes_bf16", lambda: True)
    assert demo_precision.main(["cpu"]) == 0
    assert capsys.readouterr() == ("\n", "")


def test_this_machine_is_judged_by_torchs_own_check() -> None:
    import torch

    kernels = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_computes_bf16() is (kernels and torch.backends.mkldnn.enabled)  # off: tests/avx2_cpu


def test_make_demo_passes_them_before_the_users_overrides() -> None:
    dry = subprocess.run(
        ["make", "-n", "demo", "DEMO_ARGS=train.max_steps=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    asked = re.search(r"precision=\$\((\S+) -m zerofit\.demo\.precision (\w+)\)", dry)
    assert asked and asked.group(2) in ("cpu", "cuda"), dry
    assert re.search(r"--config configs/demo-smollm2\.yaml \$precision train\.max_steps=3", dry), dry


def test_onednn_turned_off_means_no_bf16_kernels() -> None:
    """With oneDNN off in the process (as tests/avx2_cpu does to run the suite as an AVX2 CPU computes),
    torch's bf16 matmuls take the reference path: the check says so, whatever the CPU has."""
    import torch

    with torch.backends.mkldnn.flags(enabled=False):
        assert not cpu_computes_bf16()
