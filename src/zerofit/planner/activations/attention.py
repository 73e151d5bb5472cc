"""What attention saves per token: q, k, v, its output and logsumexp (sdpa, the varlen kernels), the S x S
probabilities (eager, with Gemma 2's soft-capped scores), the padding or sliding-window mask sdpa keeps, and
a fused `qkv_proj`'s whole output (Phi-3/4).
"""

from __future__ import annotations

from zerofit.planner.activations.dtypes import LayerDtypes
from zerofit.planner.activations.terms import Term, TermKind
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import ModelShape


def attention_saves(scn: Scenario, shape: ModelShape, dt: LayerDtypes) -> list[Term]:
    """What attention saves per token: q, k, v, its output and logsumexp (sdpa) or the probabilities (eager)."""
    q_dim, kv_dim, heads = shape.q_dim, shape.kv_dim, shape.num_heads
    # Padded micro-batches of >1 sequence, or packed rows: sdpa takes its masked path (GQA keys and values
    # repeated to all heads); the varlen kernels take the documents and keep k, v at their own heads.
    masked = scn.dense_mask
    kv_saved = q_dim if (masked or scn.attn_implementation == "eager") else kv_dim
    if scn.attn_implementation == "eager":
        s = scn.seq_len
        attn = dt.att * (q_dim + 2 * kv_saved) + 4 * heads * s + dt.att * heads * s
        label = f"eager attention: q, k and v (repeated to all heads), fp32 softmax + probs (S={s})"
        if shape.attn_logit_softcapping:  # Gemma 2: the scores' tanh keeps its output (heads x S)
            attn += dt.att * heads * s
            label += f", soft-capped scores (tanh output, cap {shape.attn_logit_softcapping:g})"
        return [Term(TermKind.ATTENTION, attn, label)]
    attn = dt.att * (2 * q_dim + 2 * kv_saved) + 4 * heads + _fused_qkv_extra(scn, shape, dt)
    label = "sdpa attention: q, k, v, output, logsumexp"
    if scn.attn_implementation == "varlen":
        label = f"varlen attention ({scn.varlen_kernel}): q, k, v, output, logsumexp"
    terms = [Term(TermKind.ATTENTION, attn, label)]
    if masked:
        # sdpa converts the boolean padding mask to an additive one per call and keeps it for backward.
        label = f"sdpa additive padding mask (S={scn.seq_len})"
        terms.append(Term(TermKind.PADDING_MASK, dt.att * scn.seq_len, label))
    elif shape.sliding_layers and scn.seq_len > shape.sliding_window:
        # A window shorter than the sequence is not `is_causal`: sliding layers get a mask, saved the same
        # way (the layer term is an average over all layers: only `sliding_layers` of them have it).
        label = (
            f"sdpa sliding-window mask (S={scn.seq_len}, window {shape.sliding_window}, "
            f"{shape.sliding_layers} of {shape.num_layers} layers)"
        )
        per_layer = dt.att * scn.seq_len * shape.sliding_layers // shape.num_layers
        terms.append(Term(TermKind.SLIDING_MASK, per_layer, label))
    return terms


def attention_output_is_saved(scn: Scenario) -> bool:
    """The attention output o_proj reads is the tensor attention itself saved (sdpa, the varlen kernels)."""
    if scn.attn_implementation == "varlen":
        return scn.varlen_kernel != "sdpa_per_document"
    return scn.attn_implementation == "sdpa"


def _fused_qkv_extra(scn: Scenario, shape: ModelShape, dt: LayerDtypes) -> int:
    """A fused `qkv_proj` (Phi-3/4): v passed on as a view keeps the whole q|k|v output alive (q and k are
    rotated into new tensors). Not when v is repeated to all heads (GQA under sdpa's dense mask or eager)."""
    if not any(lin.name.endswith("qkv_proj") for lin in shape.linears):
        return 0
    repeated = shape.num_kv_heads != shape.num_heads and (
        scn.dense_mask or scn.attn_implementation == "eager"
    )
    return 0 if repeated else dt.att * (shape.q_dim + shape.kv_dim)
