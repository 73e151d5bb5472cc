"""What the RMSNorms of a decoder layer save for backward per token (HF's fp32 upcast input, rstd and the
normalized output when the weight trains; the lean norm its input as it is and the rstd), every norm of
the family counted (Gemma's 4, Qwen3's and Gemma 3's q/k norms over each head).
"""

from __future__ import annotations

from zerofit.planner.activations.dtypes import LayerDtypes
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import ModelShape


def norm_saves(scn: Scenario, hidden: int, dt: LayerDtypes, rows: int = 1) -> int:
    """Bytes per token one RMSNorm saves for backward: HF's fp32 upcast input and rstd (+ its normalized
    output when the weight trains); the lean norm (`train.lean_norm`) its input as it is and the rstd.
    `rows`: rstds per token (a q/k norm over each head keeps one per head)."""
    if scn.lean_norm:
        return dt.resid * hidden + 4 * rows
    return 4 * hidden + 4 * rows + (dt.resid * hidden if not scn.lora else 0)


def _layer_norms(scn: Scenario, shape: ModelShape, dt: LayerDtypes) -> tuple[int, int, str]:
    """Every RMSNorm of one layer (2 for Llama; Gemma 4, Qwen3 and Gemma 3 also q/k norms per head): bytes
    per token saved, the part after attention, and the label."""
    norms = shape.norms or (
        ("input_layernorm", shape.hidden_size, 1),
        ("post_attention_layernorm", shape.hidden_size, 1),
    )
    total = post = 0
    for name, width, rows in norms:
        saved = norm_saves(scn, width, dt, rows)
        total += saved
        short = name.rpartition(".")[2]
        before_attention = name.startswith(("input_", "self_attn")) or short.startswith(("q_", "k_"))
        post += 0 if before_attention else saved
    heads = sum(1 for _, _, rows in norms if rows > 1)
    kind = "lean RMSNorms (input as it is, rstd)" if scn.lean_norm else "RMSNorms (fp32 input, rstd"
    if not scn.lean_norm:
        kind += ", normalized output)" if not scn.lora else ")"
    extra = f", {heads} of them over each q/k head" if heads else ""
    return total, post, f"{len(norms)} {kind}{extra}"
