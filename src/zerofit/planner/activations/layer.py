"""One decoder layer's saved tensors per token, as typed terms: norms, attention, the MLP (SwiGLU, a
mixture of experts' routed and shared experts, or a tiled MLP's input) and the linears' inputs; and the
merged expert weights (W + BA) a layer keeps when peft adapts the 3-D expert weights.
"""

from __future__ import annotations

from zerofit.planner.activations.attention import attention_saves
from zerofit.planner.activations.dtypes import LayerDtypes
from zerofit.planner.activations.linears import linear_input_saves
from zerofit.planner.activations.norms import _layer_norms
from zerofit.planner.activations.terms import Term, TermKind
from zerofit.planner.scenario import Scenario, compute_profile
from zerofit.planner.shapes import LoraShape, ModelShape


def layer_split(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: LayerDtypes, tiled: bool = False
) -> tuple[list[Term], int]:
    """Bytes saved for backward per token by one decoder layer, as typed terms, plus how many of those
    bytes belong after attention (o_proj, norm 2, the MLP). `tiled` (train.tiled_mlp): the MLP saves only
    its input (zerofit.levers.tiling), its intermediates exist per shard in backward (`MLP_SHARD`)."""
    h, inter = shape.hidden_size, shape.intermediate_size
    # Each RMSNorm: fp32 upcast input + rstd; normalized output too when the norm weight trains (lean: the
    # input as it is + rstd).
    all_norms, norm, label = _layer_norms(scn, shape, dt)
    terms = [Term(TermKind.NORMS, all_norms, label), *attention_saves(scn, shape, dt)]
    if tiled:
        mlp = dt.resid * h
        terms.append(Term(TermKind.TILED_MLP_INPUT, mlp, "tiled MLP: its input (intermediates per shard)"))
    elif shape.is_moe:
        moe_terms = moe_saves(scn, shape, lora, dt)
        mlp = sum(t.bytes for t in moe_terms)
        terms.extend(moe_terms)
    else:
        # SwiGLU: gate output (activation input), activation output, up output.
        mlp = 3 * dt.lin_out * inter
        terms.append(Term(TermKind.SWIGLU, mlp, "SwiGLU: gate, act(gate), up outputs"))
    linear_terms, linear_post_attention = linear_input_saves(scn, shape, lora, dt, skip_mlp=tiled)
    return terms + linear_terms, norm + mlp + linear_post_attention


def moe_saves(scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: LayerDtypes) -> list[Term]:
    """What a mixture-of-experts block saves per token (transformers 5's grouped_mm experts): each token is
    routed to k experts, so k rows run an expert MLP of width I: its fused gate|up output (2I) and act(gate)
    (I), the expert output (h, saved by the routing-weight product), three int64 indices and the weight;
    the router's fp32 softmax and logits (E wide) and its top-k. With the experts adapted (peft's
    `target_parameters`) the merged weight needs its own gradient: the gathered input (h) and the down
    projection's input (I) are saved too. A shared expert (Qwen-MoE) is a dense SwiGLU of its own width
    behind a sigmoid gate (which keeps the expert's output)."""
    m, h, k = dt.lin_out, shape.hidden_size, shape.experts_per_token
    inter, experts = shape.expert_intermediate_size, shape.num_experts
    row = m * (3 * inter + h) + 3 * 8 + m
    if lora is not None and lora.experts_adapted:
        row += m * (inter + h)
    router = 4 * experts + m * experts + 12 * k
    label = f"routed experts: {k} of {experts} per token through an MLP of {inter}, router softmax"
    terms = [Term(TermKind.MOE_ROUTED, k * row + router, label)]
    shared = shape.shared_expert_intermediate_size
    if shared:
        label = f"shared expert: SwiGLU of {shared} (gate, act(gate), up) and its sigmoid gate"
        terms.append(Term(TermKind.MOE_SHARED, 3 * m * shared + m * h + 2 * m, label))
    return terms


def merged_expert_bytes(scn: Scenario, lora: LoraShape | None) -> int:
    """Bytes one layer's merged expert weights (W + BA, rebuilt each forward in the weights' dtype) hold
    from forward to backward when peft adapts the 3-D expert weights."""
    if lora is None or not lora.experts_adapted:
        return 0
    prof = compute_profile(scn)
    return lora.merged_expert_numel * prof.half_bytes
