"""The planner per model family: the analytic tensor peak against its own FakeTensor trace of the same step.

Every catalogued family at its real config.json shape (micro 1 x 2048, LoRA r16 all-linear, strategy single,
no checkpointing), the mixtures of experts also with every routed expert adapted and with the router trained,
then the same classes at tiny shapes (tests/unit/planner/test_planner_families.py's `_tiny`). CPU only, a few
minutes; docs/platform.md ("The planner per model family") quotes the result.

    python benchmarks/planner_families.py benchmarks/results/planner_families-DATE.json
    python benchmarks/planner_families.py --smoke /tmp/pf.json      # one tiny mixture of experts (seconds)
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import sys
from pathlib import Path
from typing import Any

from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import model_shape
from zerofit.planner.trace import trace_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "planner"))
from test_planner_families import _tiny  # the tiny shapes the tests hold

REAL = [
    "meta-llama/Llama-2-7b-hf",
    "mistralai/Mistral-7B-v0.3",
    "Qwen/Qwen2.5-7B",
    "Qwen/Qwen3-8B",
    "google/gemma-2-9b",
    "google/gemma-3-12b-pt",
    "microsoft/Phi-3-mini-4k-instruct",
    "microsoft/phi-4",
    "mistralai/Mixtral-8x7B-v0.1",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen1.5-MoE-A2.7B",
]
MOE = REAL[-3:]


def point(model: str, label: str, **scenario: Any) -> dict[str, Any]:
    """One comparison: the analytic estimate and the trace of the same scenario (GiB, and the difference)."""
    attn = "eager" if model_shape(model).attn_logit_softcapping else "sdpa"  # Gemma 2: no soft-capped sdpa
    scn = Scenario(model=model, lora=True, attn_implementation=attn, **scenario)
    analytic, traced = estimate(scn).tensors_gib, trace_memory(scn).tensors_gib
    row = {"model": label, "attn_implementation": attn, **scenario}
    row |= {"analytic_gib": round(analytic, 6), "trace_gib": round(traced, 6)}
    row["diff_pct"] = round(100 * (analytic / traced - 1), 2)
    print(row, flush=True)
    return row


def main(out: str, smoke: bool = False) -> None:
    """Every point (`smoke`: one tiny mixture of experts), written to `out` as JSON."""
    if smoke:
        rows = [
            point(_tiny("Qwen/Qwen3-30B-A3B"), "tiny Qwen/Qwen3-30B-A3B", seq_len=128, micro_batch_size=1)
        ]
    else:
        rows = _all_points()
    result = {
        "what": (
            "zerofit plan's analytic tensor peak vs its FakeTensor + MemTracker trace of the same step, per "
            "family: strategy single (autocast bf16 over fp32 adapters), LoRA r16 all-linear (lora.moe_experts "
            "shared unless stated), no checkpointing, chunked loss; real shapes from the catalogue; tiny = the "
            "same classes shrunk. Gemma 2 with eager attention (transformers has no soft-capped sdpa)."
        ),
        "versions": {p: metadata.version(p) for p in ("torch", "transformers", "peft")},
        "points": rows,
    }
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


def _all_points() -> list[dict[str, Any]]:
    """Real shapes, the MoE choices at real shapes, then every family at two tiny shapes."""
    rows = [point(m, m, seq_len=2048, micro_batch_size=1) for m in REAL]
    for m in MOE:
        rows.append(point(m, m, seq_len=2048, micro_batch_size=1, lora_moe_experts="all"))
        rows.append(point(m, m, seq_len=2048, micro_batch_size=1, lora_train_router=True))
    for m in REAL:
        for seq, micro in ((128, 1), (256, 2)):
            rows.append(point(_tiny(m), f"tiny {m}", seq_len=seq, micro_batch_size=micro))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="one tiny mixture of experts (seconds)")
    args = parser.parse_args()
    main(args.out, smoke=args.smoke)
