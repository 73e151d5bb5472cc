"""What every candidate moment of one step shares (`Step`): shapes, dtypes, token and layer counts, the
terms alive through forward and backward (weight copies, checkpointed inputs, the saved layers) and the
logits the training loop holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from zerofit.planner.activations.dtypes import LayerDtypes, layer_dtypes
from zerofit.planner.activations.layer import merged_expert_bytes
from zerofit.planner.activations.norms import norm_saves
from zerofit.planner.activations.terms import Term, TermKind
from zerofit.planner.activations.transients import Transients, autocast_weight_copies, tiled_layer
from zerofit.planner.scenario import ComputeProfile, Scenario, compute_profile
from zerofit.planner.shapes import ModelShape, model_shape
from zerofit.planner.state import StateLine, dtype_label, param_counts


@dataclass(frozen=True)
class Step:
    """What every candidate moment of one step shares: shapes, dtypes, counts and the terms they reuse."""

    scn: Scenario
    shape: ModelShape
    dt: LayerDtypes
    half: str | None  # the compute profile's half dtype (for labels)
    tokens: int
    n_ckpt: int  # decoder layers checkpointed (the first n)
    n_saved: int  # decoder layers whose saved tensors are kept
    per_layer_tok: int  # one layer's saved bytes per token
    post_attention_tok: int  # the part of them after attention
    recomputed_tok: int  # one recomputed layer's saved bytes per token
    tr: Transients
    base: tuple[Term, ...]  # alive through forward and backward: weight copies, checkpoints, saved layers
    logits: tuple[Term, ...]  # the logits the training loop holds (none under fused_linear)
    ids: int  # the input ids the embedding's backward keeps (full fine-tuning only)
    in_layer: tuple[Term, ...]  # bytes that exist only while a decoder layer runs
    mlp_backward: tuple[Term, ...] = ()  # tiled MLP: one shard's intermediates + the input-gradient buffer
    layer_fixed: int = 0  # bytes one layer saves independent of tokens (merged expert weights)

    @property
    def last_recomputed(self) -> bool:
        """True when every layer is checkpointed (the last layer is recomputed in backward)."""
        return self.n_saved == 0

    def recomputed(self, which: str) -> Term:
        """One recomputed layer's saved tensors; `which` names it (`last layer`, `layer 3`)."""
        label = f"recomputed {which} ({self.tokens} tokens x {self.recomputed_tok:,} B)"
        if self.layer_fixed:
            label += f" + {self.layer_fixed:,} B of merged expert weights"
        nbytes = self.recomputed_tok * self.tokens + self.layer_fixed
        return Term(TermKind.RECOMPUTED_LAYER, nbytes, label)

    def input_ids(self) -> list[Term]:
        """The embedding backward's input ids, when it keeps them."""
        return [Term(TermKind.INPUT_IDS, self.ids, "input ids (embedding backward)")] if self.ids else []

    def live(self) -> list[Term]:
        """Tensors alive around the last layer's down projection in forward (not yet saved)."""
        label = "live tensors around the last layer's down projection"
        return [Term(TermKind.LIVE_TENSORS, self.tr.forward_extra * self.tokens, label), *self.input_ids()]


def base_terms(
    st_scn: Scenario,
    shape: ModelShape,
    dt: LayerDtypes,
    n_ckpt: int,
    per_layer_tok: int,
    layer_fixed: int = 0,
) -> list[Term]:
    """Alive through forward and backward: autocast's weight copies, the checkpointed inputs with the
    rotary tables (and the padding mask they keep), the saved tensors of the layers not checkpointed."""
    scn, h, n_layers = st_scn, shape.hidden_size, shape.num_layers
    b, s = scn.rows, scn.seq_len
    tokens, n_saved = b * s, n_layers - n_ckpt
    copies = autocast_weight_copies(scn, shape, param_counts(scn), dt)
    terms = [Term(TermKind.AUTOCAST_WEIGHT_COPIES, copies, "autocast half copies of fp32 matmul weights")]
    terms = terms if copies else []
    # Shared by all layers: rotary cos/sin (one sequence wide). The boolean padding mask (B x 1 x S x S)
    # lives through the forward; under checkpointing every layer keeps it as an input until backward.
    rope = 2 * s * shape.head_dim * dt.resid
    if n_ckpt:
        # Offloaded: at most two layer inputs on the GPU (the one in use and the one prefetched).
        on_gpu = min(n_ckpt, 2) if scn.activation_offload else n_ckpt
        where = f" on the GPU, {n_ckpt} offloaded" if scn.activation_offload else ""
        label = f"checkpointed layer inputs ({on_gpu} layers{where} x {tokens} tokens x {dt.resid * h:,} B)"
        terms.append(Term(TermKind.CHECKPOINTED_INPUTS, on_gpu * dt.resid * h * tokens, label))
        mask = bool_mask_bytes(scn)
        label = "rotary cos/sin" + (" + boolean padding mask" if mask else "") + " (kept by the checkpoints)"
        terms.append(Term(TermKind.ROTARY, rope + mask, label))
    else:
        terms.append(Term(TermKind.ROTARY, rope, "rotary cos/sin"))
    if n_saved:
        # Under LoRA nothing before layer 0's first adapter needs a gradient: its first RMSNorm saves nothing.
        layer0_saving = 0 if (not scn.lora or n_ckpt) else norm_saves(scn, h, dt)
        label = f"saved activations ({n_saved} layers x {tokens} tokens x {per_layer_tok:,} B)"
        saved = (n_saved * per_layer_tok - layer0_saving) * tokens + n_saved * layer_fixed
        if layer_fixed:
            label += f" + {n_saved} x {layer_fixed:,} B of merged expert weights"
        terms.append(Term(TermKind.SAVED_LAYERS, saved, label))
    return terms


def bool_mask_bytes(scn: Scenario) -> int:
    """Bytes of the boolean padding mask (B x 1 x S x S) sdpa is given for masked micro-batches."""
    b, s = scn.rows, scn.seq_len
    return b * s * s if scn.dense_mask else 0


def step_of(scn: Scenario, layer_resident: Iterable[StateLine]) -> tuple[Step, list[Term], ComputeProfile]:
    """The shared quantities of every candidate moment, with one layer's per-token terms."""
    prof = compute_profile(scn)
    shape = model_shape(scn.model)
    lora = scn.lora_shape() if scn.lora else None
    dt = layer_dtypes(scn, prof)
    tokens = scn.rows * scn.seq_len  # a preference micro-batch: both sequences of every pair
    n_ckpt = scn.checkpointed(shape.num_layers)
    layer_terms, post_attention_tok, tr, mlp_backward = tiled_layer(scn, shape, lora, dt, tokens)
    per_layer_tok = sum(t.bytes for t in layer_terms)
    layer_fixed = merged_expert_bytes(scn, lora)  # bytes a layer saves whatever its token count
    v = shape.vocab_size
    logits_label = (
        f"logits ({dtype_label(dt.logits, prof.half)}, {tokens} x {v:,}), held by the training loop"
    )
    st = Step(
        scn=scn,
        shape=shape,
        dt=dt,
        half=prof.half,
        tokens=tokens,
        n_ckpt=n_ckpt,
        n_saved=shape.num_layers - n_ckpt,
        per_layer_tok=per_layer_tok,
        post_attention_tok=post_attention_tok,
        # A recomputed layer's first RMSNorm saves its input (lean) or its fp32 upcast: that is the
        # checkpointed input itself when lean or already fp32.
        recomputed_tok=per_layer_tok
        - (dt.resid * shape.hidden_size if scn.lean_norm or dt.resid == 4 else 0),
        tr=tr,
        base=tuple(base_terms(scn, shape, dt, n_ckpt, per_layer_tok, layer_fixed)),
        layer_fixed=layer_fixed,
        logits=()
        if scn.cross_entropy == "fused_linear"
        else (Term(TermKind.LOGITS, dt.logits * v * tokens, logits_label),),
        ids=8 * tokens if not scn.lora else 0,  # the embedding's backward keeps the input ids
        in_layer=tuple(Term(TermKind.LAYER_RESIDENT, line.bytes, line.label) for line in layer_resident),
        mlp_backward=mlp_backward,
    )
    return st, layer_terms, prof
