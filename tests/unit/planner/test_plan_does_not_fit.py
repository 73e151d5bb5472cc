"""The screen of `zerofit plan` for a run that does not fit: it leads with what to change, the
smallest change first (the micro-batch the table already shows fits), prints every remedy's overrides whole
at any terminal width (a user copies them), and frames nothing about an out-of-memory run as a speed tip.

The run: Llama-3-8B LoRA at 2048 tokens, micro 4, on a 3090 (25.42 of 23.69 GiB; micro 2 fits).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from zerofit.cli import main

REPO = Path(__file__).resolve().parents[3]
TOO_BIG = [
    "plan",
    "--config",
    str(REPO / "configs" / "llama2-7b-lora-3090.yaml"),
    "--gpu",
    "rtx3090",
    "model.name_or_path=meta-llama/Meta-Llama-3-8B",
    "data.max_seq_len=2048",
]
# What reads as a speed suggestion: the fastest plan offered, a speed-up, "x faster".
SPEED_TIP = re.compile(r"Fastest plan:|a suggestion|Predicted speed-up|\d\.\d\dx faster|Configured: ")


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("zerofit.planner.search.budget.detected_gpu", lambda: None)


@pytest.fixture(scope="module")
def memory() -> dict[str, Any]:
    """`zerofit plan --json`'s memory block of the run that does not fit."""
    from zerofit.api import plan

    overrides = {"model__name_or_path": "meta-llama/Meta-Llama-3-8B", "data__max_seq_len": 2048}
    return json.loads(json.dumps(plan(TOO_BIG[2], gpu="rtx3090", **overrides), default=str))["memory"]


def test_the_smallest_fix_leads_and_no_remedy_is_listed_that_the_micro_batch_alone_makes_needless(
    memory: dict[str, Any],
) -> None:
    assert memory["verdict"] == "does not fit" and round(memory["total_gib"], 2) == 25.42
    first, *others = memory["remedies"]
    # The micro-batch the table marks `fits <- auto`, as the one key to change.
    assert memory["auto_micro_batch_size"] == 2
    assert first["how"] == "batch.micro_batch_size=2" and first["verdict"] == "fits"
    assert first["cost"] == "16 micro-steps per optimizer step instead of 8 (the same global batch)"
    # 8-bit AdamW, QLoRA, the combination fit only at micro 2 too: a second change for nothing.
    names = [r["remedy"] for r in others]
    assert not any(n.startswith(("8-bit", "QLoRA", "combined")) for n in names), names
    assert others and all(r["verdict"] == "fits" and r["micro_batch_size"] > 2 for r in others), others
    assert all(r["cost"] for r in memory["remedies"])


@pytest.mark.slow
@pytest.mark.parametrize("columns", ["80", "60"])
def test_the_screen_leads_with_what_to_change_and_prints_every_override_whole(
    columns: str, memory: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    assert main(TOO_BIG) == 0
    out = capsys.readouterr().out
    assert "Verdict: DOES NOT FIT" in out
    for remedy in memory["remedies"]:
        assert remedy["how"] in out, (remedy["how"], out)  # whole: not cut (…) nor broken over lines
    assert "…" not in out[: out.index("Micro-batch sizes")]
    after_verdict = out[out.index("Verdict:") :]
    assert after_verdict.index("What to change") < after_verdict.index("Micro-batch sizes")
    assert after_verdict.index("1. a smaller micro-batch") < after_verdict.index("2. ")
    assert not SPEED_TIP.search(out), SPEED_TIP.search(out)
