"""Short-lived tensors of a step: autocast's half weight copies, the working sets around a layer's widest
op (its MLP's down projection) in forward and backward, and how a tiled MLP (`train.tiled_mlp`) shrinks
them to one token shard at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerofit.planner.activations.dtypes import LayerDtypes
from zerofit.planner.activations.layer import layer_split
from zerofit.planner.activations.terms import Term, TermKind
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import LoraShape, ModelShape
from zerofit.planner.state import ParamCounts


def autocast_weight_copies(scn: Scenario, shape: ModelShape, counts: ParamCounts, dt: LayerDtypes) -> int:
    """Half copies of fp32 matmul weights that autocast caches for the whole forward+backward."""
    if dt.autocast_half is None:
        return 0
    half = dt.autocast_half
    copies = 0
    if scn.lora:
        copies += half * counts.trainable  # fp32 adapters: A and B cast once per step
    else:
        copies += half * sum(lin.params for lin in shape.linears) * shape.num_layers
    head_fp32 = not scn.lora or (scn.quantization != "none" and scn.fp32_residual)  # fp32 head weight
    # The fused loss runs lm_head with autocast off and casts the weight itself (a loss temporary).
    if head_fp32 and scn.cross_entropy != "fused_linear":
        copies += half * shape.vocab_size * shape.hidden_size
    return copies


@dataclass(frozen=True)
class Transients:
    """Per-token bytes of short-lived tensors at the two moments inside a decoder layer that can be the peak."""

    forward_extra: int  # end of forward, last layer's down projection: live tensors not (yet) saved
    backward_extra: int  # backward of a layer's down projection: gradients in flight minus what it freed
    incoming_grads: int  # gradients waiting when a checkpointed layer starts recomputing


def layer_transients(scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: LayerDtypes) -> Transients:
    """Working sets around the widest op of a layer (the MLP's down projection, I = intermediate wide).

    Forward, as the last layer computes its down projection: the residual stream and the base output
    (h wide), the SwiGLU product if nothing saved it, and under autocast the fp32 cast peft makes for
    the adapter before autocast takes its half copy.
    Backward, as gradients reach the down projection's input: the incoming residual gradient (h wide), the
    base and adapter partial gradients and their sum (I wide; an fp32 adapter partial is cast down
    first), minus what the down projection's nodes saved and have just released.
    """
    h, inter = shape.hidden_size, shape.intermediate_size
    if shape.is_moe:  # the routed rows: k per token through an expert MLP (and the shared expert's)
        inter = (
            shape.experts_per_token * shape.expert_intermediate_size + shape.shared_expert_intermediate_size
        )
    m, ac, a = dt.lin_out, dt.autocast_half, dt.adapter
    full = not scn.lora
    targets = {t.name.rpartition(".")[2] for t in (lora.layer_targets if lora else ())}
    lora_down = "down_proj" in targets
    dropout = lora_down and scn.lora_dropout > 0
    lora_c = ac or a  # dtype of the adapter's matmuls (and their input gradients)
    if full:
        p_shared = not (ac is not None and m != ac)
        own_copy = 0 if p_shared else (ac or m)
    else:
        p_shared = False
        own_copy = 0
    lora_copy = 0
    if lora_down:
        if dropout:
            lora_copy = lora_c
        elif ac is not None:
            if m == ac and a == ac:
                p_shared = True
            else:
                lora_copy = ac
        elif m == a:
            p_shared = True
        else:
            lora_copy = a
    freed = (m * inter if p_shared else 0) + (own_copy + lora_copy) * inter
    if lora_down:
        freed += lora_c * (lora.r if lora else 0) + (inter if dropout else 0)
    cast_partial = lora_down and lora_c != m
    partials = max(3 * m, 2 * m + lora_c if cast_partial else 0) * inter
    backward_extra = dt.resid * h + partials - freed
    forward_extra = dt.resid * h + m * h + (0 if p_shared else m * inter)
    if lora_down and m != a and (ac is not None or dropout):
        forward_extra += a * inter  # peft's cast of the input, alive while the adapter's copy is made
    if dropout and ac is not None:
        forward_extra += a * inter  # the dropout output, alive while autocast makes its half copy
    # The gradient at the layer's output; with an adapter on the down projection also its scaled copy for
    # the adapter branch (and that copy's cast), all alive when the recomputation is triggered.
    incoming = dt.resid * h + (2 * lora_c * h if lora_down else 0)
    return Transients(forward_extra=forward_extra, backward_extra=backward_extra, incoming_grads=incoming)


def tiled_layer(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: LayerDtypes, tokens: int
) -> tuple[list[Term], int, Transients, tuple[Term, ...]]:
    """One layer's saved terms, their post-attention part, the layer's transients and (tiled MLP) the
    terms of its MLP's backward. With s = train.tiled_mlp shards a layer saves only its MLP's input; the
    intermediates, the forward's passing set and the backward's partial gradients exist for tokens / s at
    a time; the gradient buffer of the MLP input is full size (zerofit.levers.tiling)."""
    terms, post = layer_split(scn, shape, lora, dt)
    tr = layer_transients(scn, shape, lora, dt)
    s = scn.tiled_mlp
    if s <= 1:
        return terms, post, tr, ()
    tiled_terms, tiled_post = layer_split(scn, shape, lora, dt, tiled=True)
    h, resid, m = shape.hidden_size, dt.resid, dt.lin_out
    # The untiled MLP's saved intermediates per token (the tiled layer keeps its input instead).
    mlp_tok = sum(t.bytes for t in terms) - sum(t.bytes for t in tiled_terms) + resid * h
    shard_tok = (mlp_tok + tr.backward_extra - resid * h) / s
    # Forward (no grad, shard by shard): the shard's gate, up and act(gate) * up, nothing saved.
    fwd_pass = tr.forward_extra - resid * h - m * h + 3 * m * shape.intermediate_size
    tiled_tr = Transients(
        forward_extra=resid * h + m * h + int(fwd_pass / s),
        backward_extra=resid * h,
        incoming_grads=tr.incoming_grads,
    )
    backward = (
        Term(TermKind.MLP_SHARD, int(shard_tok * tokens), f"tiled MLP backward: one of {s} token shards"),
        Term(TermKind.MLP_INPUT_GRAD, resid * h * tokens, "tiled MLP: input gradient buffer (full size)"),
    )
    return tiled_terms, tiled_post, tiled_tr, backward
