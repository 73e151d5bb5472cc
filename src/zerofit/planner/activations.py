"""Activations at the forward/backward peak: saved tensors per layer and token, logits, loss temporaries.

Activation bytes per token of one decoder layer are a sum of typed terms (`Term`: a `TermKind` saying what
it models, its bytes and its display label; see `_layer_split`). Code selects terms by kind, never by label. The rules
come from which tensors autograd saves for backward:
  - RMSNorm saves its fp32 upcast input and the per-token rstd (and its normalized output when its weight
    trains); the lean RMSNorm (train.lean_norm, zerofit.norms) its input as it is and the rstd;
  - a linear saves its input only when its weight trains; a frozen base linear saves nothing, its LoRA
    adapter saves its own input: the same storage as the base's input when the dtypes agree, else its own
    cast copy (fp32 adapters under a bf16 base, or a bf16 copy under autocast), plus the rank-r output of A;
  - attention (sdpa) saves q, k, v, the output and a per-head logsumexp; eager attention also keeps the
    S x S probabilities (fp32 softmax output and its half copy);
  - SwiGLU saves gate and up outputs and the activation's output;
  - dropout keeps a one-byte mask per element (CUDA).

Per family (issue 18; the shapes come from the model class, `ModelShape`): every RMSNorm of a layer counts
(Gemma's 4, Qwen3's and Gemma 3's q/k norms over each head); a fused `qkv_proj` (Phi-3/4) keeps its whole
output alive through v; sliding-window layers attend through a saved mask when the window is shorter than
the sequence; Gemma 2's soft-capping keeps the tanh output of the attention scores (eager: transformers has
no soft-capped sdpa) and of the final logits; a mixture of experts routes k rows per token through an expert
MLP (`_moe_saves`) and, when peft adapts the fused 3-D expert weights, each layer saves their merged copy
W + BA (a per-layer constant, not per token).

Selective checkpointing (the first n of L layers recomputed) keeps n layer inputs and L - n layers of saved
tensors; the loss's temporaries depend on `train.cross_entropy` (`zerofit.loss`): unchunked holds fp32
log-probabilities and two fp32 (tokens x vocab) gradients, chunked a gradient in the logits' dtype and one
fp32 chunk.

Preference tuning (`Scenario.rows`): a micro-batch of m pairs is one forward of 2m sequences, so every
per-token term counts 2m x seq_len tokens; DPO's reference with the adapters off is one more moment, a
no-grad forward of the same rows before the policy's (`_reference_moments`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from zerofit.loss import chunk_tokens
from zerofit.planner.scenario import ComputeProfile, Scenario, compute_profile
from zerofit.planner.shapes import LoraShape, ModelShape, lora_shape, model_shape
from zerofit.planner.state import ParamCounts, StateLine, dtype_label, param_counts
from zerofit.precision import dtype_bytes


@dataclass(frozen=True)
class _Dt:
    """Per-element byte sizes of the tensors in a decoder layer under a compute profile."""

    resid: int  # residual stream (embedding output dtype)
    lin_out: int  # output of a base linear
    att: int  # tensors attention saves
    logits: int
    adapter: int  # LoRA compute dtype without autocast
    autocast_half: int | None  # half dtype when autocast is on


def _dtypes(scn: Scenario, prof: ComputeProfile) -> _Dt:
    half_b = prof.half_bytes
    if prof.cast_params_to is not None:
        store = half_b  # DeepSpeed / FSDP2: everything computes in the half dtype
        adapter = half_b
    else:
        # k-bit preparation upcasts norms and embeddings to fp32 (quantization.fp32_residual); without it
        # the residual stream stays in the compute dtype.
        kbit_fp32 = scn.quantization != "none" and scn.fp32_residual
        store = dtype_bytes("fp32" if kbit_fp32 else prof.load)
        if scn.quantization != "none" and not scn.fp32_residual:
            store = half_b
        adapter = 4
    resid = store
    ac = half_b if prof.autocast else None
    # bitsandbytes returns its output in the input's dtype; otherwise autocast or the weights decide.
    lin_out = resid if scn.quantization != "none" else (ac or store)
    att = ac or lin_out
    logits = ac or store
    return _Dt(resid=resid, lin_out=lin_out, att=att, logits=logits, adapter=adapter, autocast_half=ac)


def residual_bytes(scn: Scenario) -> int:
    """Bytes per element of the residual stream (what a checkpointed layer input is stored in)."""
    return _dtypes(scn, compute_profile(scn)).resid


class TermKind(StrEnum):
    """What an activation-side memory term models (its label is only for display)."""

    # Saved for backward by one decoder layer, per token.
    NORMS = "norms"
    ATTENTION = "attention"
    PADDING_MASK = "padding mask"
    SLIDING_MASK = "sliding-window mask"
    SWIGLU = "swiglu"
    MOE_ROUTED = "routed experts"  # per token: k routed rows through an expert MLP, the router's softmax
    MOE_SHARED = "shared expert"  # per token: the always-on shared expert (Qwen-MoE) and its gate
    MERGED_EXPERTS = "merged expert weights"  # per layer: W + BA of adapted 3-D expert weights, saved
    SHARED_LINEAR_INPUTS = "shared linear inputs"
    LINEAR_INPUT_COPIES = "linear input copies"
    LORA_A_OUTPUTS = "lora A outputs"
    LORA_DROPOUT_MASKS = "lora dropout masks"
    # Bytes per rank at one moment of the step.
    AUTOCAST_WEIGHT_COPIES = "autocast weight copies"
    CHECKPOINTED_INPUTS = "checkpointed layer inputs"
    ROTARY = "rotary (and the checkpoints' mask)"
    SAVED_LAYERS = "saved layers"
    HEAD_INPUTS = "final norm and lm_head saved inputs"
    LOGITS = "logits"
    LOGITS_SOFTCAP = "soft-capped logits"  # final logit soft-capping: the tanh's saved output
    LOSS_LOG_PROBS = "loss log-probabilities"
    LOSS_GRADIENTS = "loss gradients"
    LOSS_CHUNK = "loss chunk"
    LOSS_PER_TOKEN = "loss per-token"
    INPUT_IDS = "input ids"
    RECOMPUTED_LAYER = "recomputed layer"
    GRADS_IN_FLIGHT = "gradients in flight"
    HEAD_WEIGHT_GRAD = "lm_head weight gradient"
    LAYER_RESIDENT = "layer resident"
    EAGER_ATTENTION_BACKWARD = "eager attention backward"
    LIVE_TENSORS = "live tensors"
    GRADS_WAITING = "gradients waiting"
    EMBEDDING_OUTPUT = "embedding output"
    FINAL_NORM_FORWARD = "final norm forward"
    # Long-context levers (issue 16).
    TILED_MLP_INPUT = "tiled MLP saved input"  # per token, a tiled layer keeps its MLP's input only
    MLP_SHARD = "MLP shard"  # one token shard's MLP intermediates and gradients (tiled MLP backward)
    MLP_INPUT_GRAD = "MLP input gradient"  # the tiled MLP's full-size input-gradient buffer
    OFFLOADED_INPUTS = "offloaded checkpointed inputs"  # host RAM (pinned), not the GPU
    FUSED_LOSS_TEMPORARY = "fused loss temporary"  # fused_linear: one chunk's logits work + weight cast
    FUSED_HEAD_GRAD = "fused loss head weight gradient"  # fused_linear, trainable head
    # Preference tuning (issue 17): DPO's reference forward with the adapters off, under no_grad.
    REFERENCE_FORWARD = "reference forward"


# Kinds that are tensors autograd saves for backward (what `saved_tensors_hooks` sees); the others are
# working sets of one moment (gradients in flight, live forward tensors, loss temporaries, the logits).
SAVED_FOR_BACKWARD = frozenset(
    {
        TermKind.NORMS,
        TermKind.ATTENTION,
        TermKind.PADDING_MASK,
        TermKind.SLIDING_MASK,
        TermKind.SWIGLU,
        TermKind.MOE_ROUTED,
        TermKind.MOE_SHARED,
        TermKind.MERGED_EXPERTS,
        TermKind.SHARED_LINEAR_INPUTS,
        TermKind.LINEAR_INPUT_COPIES,
        TermKind.LORA_A_OUTPUTS,
        TermKind.LORA_DROPOUT_MASKS,
        TermKind.AUTOCAST_WEIGHT_COPIES,
        TermKind.CHECKPOINTED_INPUTS,
        TermKind.ROTARY,
        TermKind.SAVED_LAYERS,
        TermKind.HEAD_INPUTS,
        TermKind.LOSS_LOG_PROBS,
        TermKind.LOGITS_SOFTCAP,
        TermKind.TILED_MLP_INPUT,
    }
)


@dataclass(frozen=True)
class Term:
    """One memory term: what it models, its bytes, and the label `zerofit plan` shows."""

    kind: TermKind
    bytes: int
    label: str

    @property
    def saved_for_backward(self) -> bool:
        """True for tensors autograd keeps until backward; False for one moment's working set."""
        return self.kind in SAVED_FOR_BACKWARD


@dataclass(frozen=True)
class Moment:
    """A moment of the step that can be the activation peak (`where`), with the terms alive then."""

    where: str
    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        """Bytes alive at this moment."""
        return sum(t.bytes for t in self.terms)


def _without(terms: tuple[Term, ...] | list[Term], *kinds: TermKind) -> list[Term]:
    """`terms` less those of the given kinds."""
    return [t for t in terms if t.kind not in kinds]


_GROUP_OF = {
    "q_proj": "attn_in",
    "k_proj": "attn_in",
    "v_proj": "attn_in",
    "o_proj": "o_in",
    "gate_proj": "mlp_in",
    "up_proj": "mlp_in",
    "down_proj": "down_in",
}
_POST_ATTENTION_GROUPS = ("o_in", "mlp_in", "down_in")


_MLP_GROUPS = ("mlp_in", "down_in")


def _norm_saves(scn: Scenario, hidden: int, dt: _Dt, rows: int = 1) -> int:
    """Bytes per token one RMSNorm saves for backward: HF's fp32 upcast input and rstd (+ its normalized
    output when the weight trains); the lean norm (`train.lean_norm`) its input as it is and the rstd.
    `rows`: rstds per token (a q/k norm over each head keeps one per head)."""
    if scn.lean_norm:
        return dt.resid * hidden + 4 * rows
    return 4 * hidden + 4 * rows + (dt.resid * hidden if not scn.lora else 0)


def _layer_norms(scn: Scenario, shape: ModelShape, dt: _Dt) -> tuple[int, int, str]:
    """Every RMSNorm of one layer (2 for Llama; Gemma 4, Qwen3 and Gemma 3 also q/k norms per head): bytes
    per token saved, the part after attention, and the label."""
    norms = shape.norms or (
        ("input_layernorm", shape.hidden_size, 1),
        ("post_attention_layernorm", shape.hidden_size, 1),
    )
    total = post = 0
    for name, width, rows in norms:
        saved = _norm_saves(scn, width, dt, rows)
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


def _layer_split(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt, tiled: bool = False
) -> tuple[list[Term], int]:
    """Bytes saved for backward per token by one decoder layer, as typed terms, plus how many of those
    bytes belong after attention (o_proj, norm 2, the MLP). `tiled` (train.tiled_mlp): the MLP saves only
    its input (zerofit.tiling), its intermediates exist per shard in backward (`MLP_SHARD`)."""
    h, inter = shape.hidden_size, shape.intermediate_size
    # Each RMSNorm: fp32 upcast input + rstd; normalized output too when the norm weight trains (lean: the
    # input as it is + rstd).
    all_norms, norm, label = _layer_norms(scn, shape, dt)
    terms = [Term(TermKind.NORMS, all_norms, label), *_attention_saves(scn, shape, dt)]
    if tiled:
        mlp = dt.resid * h
        terms.append(Term(TermKind.TILED_MLP_INPUT, mlp, "tiled MLP: its input (intermediates per shard)"))
    elif shape.is_moe:
        moe_terms = _moe_saves(scn, shape, lora, dt)
        mlp = sum(t.bytes for t in moe_terms)
        terms.extend(moe_terms)
    else:
        # SwiGLU: gate output (activation input), activation output, up output.
        mlp = 3 * dt.lin_out * inter
        terms.append(Term(TermKind.SWIGLU, mlp, "SwiGLU: gate, act(gate), up outputs"))
    linear_terms, linear_post_attention = _linear_input_saves(scn, shape, lora, dt, skip_mlp=tiled)
    return terms + linear_terms, norm + mlp + linear_post_attention


def _moe_saves(scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt) -> list[Term]:
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


def _merged_expert_bytes(scn: Scenario, lora: LoraShape | None) -> int:
    """Bytes one layer's merged expert weights (W + BA, rebuilt each forward in the weights' dtype) hold
    from forward to backward when peft adapts the 3-D expert weights."""
    if lora is None or not lora.experts_adapted:
        return 0
    prof = compute_profile(scn)
    return lora.merged_expert_numel * prof.half_bytes


def _attention_saves(scn: Scenario, shape: ModelShape, dt: _Dt) -> list[Term]:
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


def _output_is_saved(scn: Scenario) -> bool:
    """The attention output o_proj reads is the tensor attention itself saved (sdpa, the varlen kernels)."""
    if scn.attn_implementation == "varlen":
        return scn.varlen_kernel != "sdpa_per_document"
    return scn.attn_implementation == "sdpa"


def _fused_qkv_extra(scn: Scenario, shape: ModelShape, dt: _Dt) -> int:
    """A fused `qkv_proj` (Phi-3/4): v passed on as a view keeps the whole q|k|v output alive (q and k are
    rotated into new tensors). Not when v is repeated to all heads (GQA under sdpa's dense mask or eager)."""
    if not any(lin.name.endswith("qkv_proj") for lin in shape.linears):
        return 0
    repeated = shape.num_kv_heads != shape.num_heads and (
        scn.dense_mask or scn.attn_implementation == "eager"
    )
    return 0 if repeated else dt.att * (shape.q_dim + shape.kv_dim)


@dataclass
class _LinearSaves:
    """Running per-token counts of what the linears (base and LoRA) save for backward."""

    shared: set[str]
    own_copies: int = 0
    lora_rank_io: int = 0
    dropout_masks: int = 0

    @property
    def own(self) -> int:
        """Bytes that belong to one linear alone (not shared with another reader of its input)."""
        return self.own_copies + self.lora_rank_io + self.dropout_masks


def _save_linear(
    acc: _LinearSaves, scn: Scenario, dt: _Dt, group: str, width: int, x_b: int, lora_r: int | None
) -> None:
    """Add one linear's saved input to `acc`: shared storage, or its own cast copy (autocast, peft)."""
    ac = dt.autocast_half
    if not scn.lora:
        if ac is not None and x_b != ac:
            acc.own_copies += ac * width  # autocast casts the input for each linear
        else:
            acc.shared.add(group)
    if lora_r is None:
        return
    if scn.lora_dropout > 0:
        acc.dropout_masks += width
        # dropout output in the adapter dtype; under autocast A saves a half copy of it instead
        acc.own_copies += (ac or dt.adapter) * width
    elif ac is not None:
        if x_b != ac or dt.adapter != ac:
            acc.own_copies += ac * width
        else:
            acc.shared.add(group)
    elif x_b != dt.adapter:
        acc.own_copies += dt.adapter * width  # peft casts the input to the adapter dtype
    else:
        acc.shared.add(group)
    acc.lora_rank_io += (ac or dt.adapter) * lora_r


def _linear_input_saves(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt, skip_mlp: bool = False
) -> tuple[list[Term], int]:
    """The linears' saved inputs per token, as terms, and the part of them after attention (`skip_mlp`:
    without the MLP's linears, which a tiled MLP runs without saving)."""
    h = shape.hidden_size
    # Linear inputs, by the tensor they read: (width, dtype of that tensor, already saved by attention).
    groups = {
        "attn_in": (h, dt.resid, False),
        # o_proj reads the attention output the kernel saved, except the per-document sdpa's, which is a
        # concatenation of the documents' outputs (a copy of its own).
        "o_in": (shape.q_dim, dt.att, _output_is_saved(scn)),
        "mlp_in": (h, dt.resid, False),
        "down_in": (shape.shared_expert_intermediate_size or shape.intermediate_size, dt.lin_out, False),
    }
    acc = _LinearSaves(shared=set())
    post_attention = 0
    targets = {t.name.rpartition(".")[2] for t in (lora.layer_targets if lora else ())}
    for lin in shape.linears:
        short = lin.name.rpartition(".")[2]
        group = _GROUP_OF.get(short, lin.name)
        if skip_mlp and group in _MLP_GROUPS:
            continue
        width, x_b, _ = groups.get(group, (lin.in_features, dt.resid, False))
        before = acc.own
        adapter_r = lora.r if (lora is not None and short in targets) else None
        _save_linear(acc, scn, dt, group, width, x_b, adapter_r)
        if group in _POST_ATTENTION_GROUPS:
            post_attention += acc.own - before
    if lora is not None and lora.router_adapted:
        acc.shared.add("mlp_in")  # the router's merged weight needs its input: the MLP's normed input
    counted = [g for g in acc.shared if g in groups and not groups[g][2]]
    shared = sum(groups[g][0] * groups[g][1] for g in counted)
    post_attention += sum(groups[g][0] * groups[g][1] for g in counted if g in _POST_ATTENTION_GROUPS)
    candidates = [
        Term(TermKind.SHARED_LINEAR_INPUTS, shared, "linear inputs shared by the projections reading them"),
        Term(
            TermKind.LINEAR_INPUT_COPIES,
            acc.own_copies,
            "per-linear input copies (dtype casts / dropout outputs)",
        ),
        Term(TermKind.LORA_A_OUTPUTS, acc.lora_rank_io, f"LoRA A outputs (rank {lora.r if lora else 0})"),
        Term(TermKind.LORA_DROPOUT_MASKS, acc.dropout_masks, "LoRA dropout masks (1 byte)"),
    ]
    return [t for t in candidates if t.bytes], post_attention


@dataclass(frozen=True)
class ActivationTerms:
    """Activation-side bytes at the forward/backward peak: the peak moment's typed terms."""

    peak: int
    terms: tuple[Term, ...]  # alive at the peak
    where: str  # which moment of the step is the peak
    per_layer_token_terms: tuple[Term, ...]  # saved for backward per token by one decoder layer
    moments: tuple[Moment, ...]  # every candidate for the peak, the peak among them
    host: tuple[Term, ...] = ()  # in host RAM, not on the GPU (offloaded checkpointed inputs)

    @property
    def lines(self) -> dict[str, int]:
        """The peak's terms by display label (what the plan shows)."""
        return {t.label: t.bytes for t in self.terms}

    def bytes_of(self, *kinds: TermKind) -> int:
        """Bytes of the peak's terms of the given kinds."""
        return sum(t.bytes for t in self.terms if t.kind in kinds)


def _autocast_weight_copies(scn: Scenario, shape: ModelShape, counts: ParamCounts, dt: _Dt) -> int:
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
class _Transients:
    """Per-token bytes of short-lived tensors at the two moments inside a decoder layer that can be the peak."""

    forward_extra: int  # end of forward, last layer's down projection: live tensors not (yet) saved
    backward_extra: int  # backward of a layer's down projection: gradients in flight minus what it freed
    incoming_grads: int  # gradients waiting when a checkpointed layer starts recomputing


def _transients(scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt) -> _Transients:
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
    return _Transients(forward_extra=forward_extra, backward_extra=backward_extra, incoming_grads=incoming)


@dataclass(frozen=True)
class _Step:
    """What every candidate moment of one step shares: shapes, dtypes, counts and the terms they reuse."""

    scn: Scenario
    shape: ModelShape
    dt: _Dt
    half: str | None  # the compute profile's half dtype (for labels)
    tokens: int
    n_ckpt: int  # decoder layers checkpointed (the first n)
    n_saved: int  # decoder layers whose saved tensors are kept
    per_layer_tok: int  # one layer's saved bytes per token
    post_attention_tok: int  # the part of them after attention
    recomputed_tok: int  # one recomputed layer's saved bytes per token
    tr: _Transients
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


def _loss_terms(st: _Step, ce_tokens: int) -> list[tuple[str, list[Term]]]:
    """The loss's own peaks (forward and backward of the cross-entropy), terms besides the saved tensors."""
    scn, dt, tokens, vocab = st.scn, st.dt, st.tokens, st.shape.vocab_size
    if scn.cross_entropy == "unchunked":
        return [
            (
                "loss backward (cross-entropy's fp32 gradients)",
                [
                    *st.logits,
                    Term(
                        TermKind.LOSS_LOG_PROBS,
                        4 * vocab * ce_tokens + 8 * ce_tokens,
                        "log-probabilities (fp32) + targets",
                    ),
                    Term(
                        TermKind.LOSS_GRADIENTS,
                        8 * vocab * ce_tokens,
                        "cross-entropy backward: 2 fp32 (tokens x vocab) gradients",
                    ),
                ],
            )
        ]
    per_token = Term(
        TermKind.LOSS_PER_TOKEN, 12 * tokens, "cross-entropy: per-token log-sum-exp (fp32) + targets"
    )
    if scn.cross_entropy == "liger":
        # Liger computes the gradient in forward, into the logits' own storage.
        return [("loss (Liger cross-entropy, gradient in the logits' storage)", [*st.logits, per_token])]
    if scn.cross_entropy == "fused_linear":
        return _fused_loss_terms(st, per_token)
    chunk = min(chunk_tokens(vocab), tokens)
    upcasts = 1 if dt.logits == 4 else 2  # the fp32 copy of the chunk (none for fp32 logits) + logsumexp's
    grad_label = (
        f"chunked cross-entropy: logits gradient ({dtype_label(dt.logits, st.half)}, {tokens} x {vocab:,})"
    )
    chunk_label = f"chunked cross-entropy: one fp32 chunk ({chunk} tokens x {vocab:,})"
    fwd_label = f"chunked cross-entropy: fp32 chunk + logsumexp temporary ({chunk} tokens x {vocab:,})"
    return [
        (
            "loss backward (chunked cross-entropy)",
            [
                *st.logits,
                Term(TermKind.LOSS_GRADIENTS, dt.logits * vocab * tokens, grad_label),
                Term(TermKind.LOSS_CHUNK, 4 * vocab * chunk, chunk_label),
                per_token,
            ],
        ),
        (
            "loss forward (chunked cross-entropy)",
            [*st.logits, Term(TermKind.LOSS_CHUNK, upcasts * 4 * vocab * chunk, fwd_label), per_token],
        ),
    ]


def _fused_loss_terms(st: _Step, per_token: Term) -> list[tuple[str, list[Term]]]:
    """`fused_linear` (zerofit.fused_loss): no logits; one chunk of C tokens x vocab at a time (C V 4 =
    128 MiB), the weight cast to the compute dtype d when it is in another, the hidden-state gradient in
    backward; a trainable head also accumulates its fp32 weight gradient (+ a d copy per chunk, + the final
    cast to the weight dtype)."""
    tokens, v, h, d = st.tokens, st.shape.vocab_size, st.shape.hidden_size, st.dt.logits
    chunk = min(chunk_tokens(v), tokens)
    w_b = st.dt.resid  # lm_head is in the residual dtype (embeddings / head: k-bit prepared or loaded)
    cast = (
        [Term(TermKind.FUSED_LOSS_TEMPORARY, v * h * d, "fused loss: lm_head weight cast")]
        if w_b != d
        else []
    )
    fwd = Term(
        TermKind.FUSED_LOSS_TEMPORARY, 8 * chunk * v, f"fused loss forward: one chunk ({chunk} x {v:,})"
    )
    bwd = Term(
        TermKind.FUSED_LOSS_TEMPORARY,
        (4 + d) * chunk * v,
        f"fused loss backward: one chunk ({chunk} x {v:,})",
    )
    hidden_grad = Term(TermKind.LOSS_GRADIENTS, tokens * h * st.dt.resid, "fused loss: hidden-state gradient")
    head: list[Term] = []
    if not st.scn.lora:
        head_b = v * h * (4 + (d if d != 4 else 0) + (w_b if w_b != 4 else 0))
        head.append(Term(TermKind.FUSED_HEAD_GRAD, head_b, "fused loss: lm_head weight gradient accumulator"))
    return [
        ("loss backward (fused linear cross-entropy)", [per_token, bwd, *cast, hidden_grad, *head]),
        ("loss forward (fused linear cross-entropy)", [per_token, fwd, *cast]),
    ]


def _loss_moments(st: _Step) -> list[Moment]:
    """The loss's peaks on top of everything saved (the final norm's and lm_head's inputs included)."""
    h, tokens, full = st.shape.hidden_size, st.tokens, not st.scn.lora
    final_norm = _norm_saves(st.scn, h, st.dt) * tokens
    head_input = 0
    if full:
        ac = st.dt.autocast_half
        head_input = (ac if ac and st.dt.resid != ac else st.dt.resid) * h * tokens
    if st.scn.cross_entropy == "fused_linear":
        head_input = st.dt.resid * h * tokens  # the fused function saves the hidden states as they are
    head = Term(TermKind.HEAD_INPUTS, final_norm + head_input + st.ids, "final norm + lm_head saved inputs")
    ce_tokens = st.scn.rows * (st.scn.seq_len - 1)
    capped = _softcap_terms(st)
    return [Moment(where, (*st.base, head, *capped, *terms)) for where, terms in _loss_terms(st, ce_tokens)]


def _softcap_terms(st: _Step) -> tuple[Term, ...]:
    """Final logit soft-capping (Gemma 2): cap * tanh(logits / cap) keeps the tanh's output, one more
    logits-sized tensor, until the loss's backward has passed through it."""
    cap = st.shape.final_logit_softcapping
    if not cap or st.scn.cross_entropy == "fused_linear" or not st.logits:
        return ()
    label = f"final logit soft-capping: tanh output (cap {cap:g}), saved"
    return (Term(TermKind.LOGITS_SOFTCAP, st.logits[0].bytes, label),)


def _last_layer_moments(st: _Step, head_grad: int) -> list[Moment]:
    """Backward of the last layer: its saved (or recomputed) tensors and the gradients in flight around its
    down projection; under eager attention also the softmax backward of that layer."""
    tokens = st.tokens
    terms = [*st.base, *st.logits, *st.input_ids(), *st.mlp_backward]
    if st.last_recomputed:
        terms.append(st.recomputed("last layer"))
    in_flight = Term(
        TermKind.GRADS_IN_FLIGHT, st.tr.backward_extra * tokens, "gradients in flight at its down projection"
    )
    terms.append(in_flight)
    if head_grad:
        terms.append(Term(TermKind.HEAD_WEIGHT_GRAD, head_grad, "lm_head weight gradient (fp32)"))
    terms.extend(st.in_layer)
    where = "backward of the last layer" + (" (recomputed)" if st.last_recomputed else "")
    moments = [Moment(where, tuple(terms))]
    if st.scn.attn_implementation == "eager":
        moments.append(_eager_attention_backward(st, terms))
    return moments


def _eager_attention_backward(st: _Step, last_layer: list[Term]) -> Moment:
    """Eager attention's backward: the fp32 gradient of the softmax output and the softmax backward's fp32
    result (both heads x S wide per token) while the half probabilities are already released. Everything
    the layer saved after attention has been released by then."""
    tokens, post = st.tokens, st.post_attention_tok
    terms = _without(last_layer, TermKind.GRADS_IN_FLIGHT)
    if st.last_recomputed:
        terms = [
            Term(t.kind, t.bytes - post * tokens, t.label) if t.kind is TermKind.RECOMPUTED_LAYER else t
            for t in terms
        ]
    extra = (8 - st.dt.att) * st.shape.num_heads * st.scn.seq_len + st.dt.resid * st.shape.hidden_size
    extra -= 0 if st.last_recomputed else post
    label = "eager attention backward: 2 fp32 (heads x S) gradients, later saves released"
    terms.append(Term(TermKind.EAGER_ATTENTION_BACKWARD, extra * tokens, label))
    return Moment("eager attention backward of the last layer", tuple(terms))


def _recompute_moment(st: _Step) -> Moment:
    """The recomputation inside backward runs the top checkpointed layer's forward again with the logits
    still held; the saved tensors of the layers above it are already released."""
    which = "last layer" if st.last_recomputed else f"layer {st.n_ckpt - 1}"
    top = "the last layer" if st.last_recomputed else f"layer {st.n_ckpt - 1} (the last checkpointed)"
    waiting = Term(
        TermKind.GRADS_WAITING, st.tr.incoming_grads * st.tokens, "gradients waiting at the layer's output"
    )
    terms = (
        *_without(st.base, TermKind.SAVED_LAYERS),
        *st.logits,
        st.recomputed(which),
        *st.live(),
        waiting,
        *st.in_layer,
    )
    return Moment(f"recomputation of {top} in backward", terms)


def _forward_moments(st: _Step, bool_mask: int) -> list[Moment]:
    """The end of forward: the last layer's down projection and the final norm, with everything saved.

    Forward keeps the embedding output (the model's local) and the boolean mask alive throughout (under
    checkpointing both are already counted: layer 0's checkpointed input, the checkpoints' mask).
    """
    h, tokens, resid = st.shape.hidden_size, st.tokens, st.dt.resid
    common: list[Term] = []
    if not st.n_ckpt:
        label = "embedding output" + (" + boolean padding mask" if bool_mask else "") + " (forward only)"
        common.append(Term(TermKind.EMBEDDING_OUTPUT, resid * h * tokens + bool_mask, label))
    # The final RMSNorm: its input, fp32 upcast (saved; the input itself when already fp32) and rstd,
    # the fp32 product, and two results in the residual dtype.
    upcast = 4 * h if resid != 4 else 0
    final_norm = Term(
        TermKind.FINAL_NORM_FORWARD, (3 * resid * h + upcast + 4 * h + 8) * tokens, "final norm forward"
    )
    return [
        Moment(
            "end of forward (last layer's down projection)", (*st.base, *common, *st.live(), *st.in_layer)
        ),
        Moment("end of forward (final norm)", (*st.base, *common, final_norm)),
    ]


def _base_terms(
    st_scn: Scenario, shape: ModelShape, dt: _Dt, n_ckpt: int, per_layer_tok: int, layer_fixed: int = 0
) -> list[Term]:
    """Alive through forward and backward: autocast's weight copies, the checkpointed inputs with the
    rotary tables (and the padding mask they keep), the saved tensors of the layers not checkpointed."""
    scn, h, n_layers = st_scn, shape.hidden_size, shape.num_layers
    b, s = scn.rows, scn.seq_len
    tokens, n_saved = b * s, n_layers - n_ckpt
    copies = _autocast_weight_copies(scn, shape, param_counts(scn), dt)
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
        mask = _bool_mask(scn)
        label = "rotary cos/sin" + (" + boolean padding mask" if mask else "") + " (kept by the checkpoints)"
        terms.append(Term(TermKind.ROTARY, rope + mask, label))
    else:
        terms.append(Term(TermKind.ROTARY, rope, "rotary cos/sin"))
    if n_saved:
        # Under LoRA nothing before layer 0's first adapter needs a gradient: its first RMSNorm saves nothing.
        layer0_saving = 0 if (not scn.lora or n_ckpt) else _norm_saves(scn, h, dt)
        label = f"saved activations ({n_saved} layers x {tokens} tokens x {per_layer_tok:,} B)"
        saved = (n_saved * per_layer_tok - layer0_saving) * tokens + n_saved * layer_fixed
        if layer_fixed:
            label += f" + {n_saved} x {layer_fixed:,} B of merged expert weights"
        terms.append(Term(TermKind.SAVED_LAYERS, saved, label))
    return terms


def _bool_mask(scn: Scenario) -> int:
    """Bytes of the boolean padding mask (B x 1 x S x S) sdpa is given for masked micro-batches."""
    b, s = scn.rows, scn.seq_len
    return b * s * s if scn.dense_mask else 0


def _step(scn: Scenario, layer_resident: Iterable[StateLine]) -> tuple[_Step, list[Term], ComputeProfile]:
    """The shared quantities of every candidate moment, with one layer's per-token terms."""
    prof = compute_profile(scn)
    shape = model_shape(scn.model)
    lora = (
        lora_shape(
            scn.model, scn.lora_r, scn.lora_targets, scn.use_dora, scn.lora_moe_experts, scn.lora_train_router
        )
        if scn.lora
        else None
    )
    dt = _dtypes(scn, prof)
    tokens = scn.rows * scn.seq_len  # a preference micro-batch: both sequences of every pair
    n_ckpt = scn.checkpointed(shape.num_layers)
    layer_terms, post_attention_tok, tr, mlp_backward = _tiling(scn, shape, lora, dt, tokens)
    per_layer_tok = sum(t.bytes for t in layer_terms)
    layer_fixed = _merged_expert_bytes(scn, lora)  # bytes a layer saves whatever its token count
    v = shape.vocab_size
    logits_label = (
        f"logits ({dtype_label(dt.logits, prof.half)}, {tokens} x {v:,}), held by the training loop"
    )
    st = _Step(
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
        base=tuple(_base_terms(scn, shape, dt, n_ckpt, per_layer_tok, layer_fixed)),
        layer_fixed=layer_fixed,
        logits=()
        if scn.cross_entropy == "fused_linear"
        else (Term(TermKind.LOGITS, dt.logits * v * tokens, logits_label),),
        ids=8 * tokens if not scn.lora else 0,  # the embedding's backward keeps the input ids
        in_layer=tuple(Term(TermKind.LAYER_RESIDENT, line.bytes, line.label) for line in layer_resident),
        mlp_backward=mlp_backward,
    )
    return st, layer_terms, prof


def _tiling(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt, tokens: int
) -> tuple[list[Term], int, _Transients, tuple[Term, ...]]:
    """One layer's saved terms, their post-attention part, the layer's transients and (tiled MLP) the
    terms of its MLP's backward. With s = train.tiled_mlp shards a layer saves only its MLP's input; the
    intermediates, the forward's passing set and the backward's partial gradients exist for tokens / s at
    a time; the gradient buffer of the MLP input is full size (zerofit.tiling)."""
    terms, post = _layer_split(scn, shape, lora, dt)
    tr = _transients(scn, shape, lora, dt)
    s = scn.tiled_mlp
    if s <= 1:
        return terms, post, tr, ()
    tiled_terms, tiled_post = _layer_split(scn, shape, lora, dt, tiled=True)
    h, resid, m = shape.hidden_size, dt.resid, dt.lin_out
    # The untiled MLP's saved intermediates per token (the tiled layer keeps its input instead).
    mlp_tok = sum(t.bytes for t in terms) - sum(t.bytes for t in tiled_terms) + resid * h
    shard_tok = (mlp_tok + tr.backward_extra - resid * h) / s
    # Forward (no grad, shard by shard): the shard's gate, up and act(gate) * up, nothing saved.
    fwd_pass = tr.forward_extra - resid * h - m * h + 3 * m * shape.intermediate_size
    tiled_tr = _Transients(
        forward_extra=resid * h + m * h + int(fwd_pass / s),
        backward_extra=resid * h,
        incoming_grads=tr.incoming_grads,
    )
    backward = (
        Term(TermKind.MLP_SHARD, int(shard_tok * tokens), f"tiled MLP backward: one of {s} token shards"),
        Term(TermKind.MLP_INPUT_GRAD, resid * h * tokens, "tiled MLP: input gradient buffer (full size)"),
    )
    return tiled_terms, tiled_post, tiled_tr, backward


def activation_terms(scn: Scenario, layer_resident: Iterable[StateLine] = ()) -> ActivationTerms:
    """Activations, logits and loss temporaries at the forward/backward peak (bytes, per rank).

    With n of L decoder layers checkpointed (the first n), the candidates (the largest is the peak):
      - end of forward (n < L): n layer inputs + L - n layers' saved tensors + the last layer's live set;
      - the loss (forward and backward of the cross-entropy, see `_loss_terms`), on top of all saved;
      - backward of the last layer (recomputed when n = L): its saved tensors + the gradients in flight
        around its down projection, with the logits still held by the training loop;
      - recomputation of layer n - 1 in backward (n > 0): the n checkpointed inputs (the layers above have
        released theirs) + the recomputed layer + the gradients waiting at its output;
      - DPO's reference forward (`preference.reference: adapters_off`): a no-grad forward of the same rows,
        nothing saved (`_reference_moments`).
    `layer_resident`: the state lines that exist only while a decoder layer runs (`Place.IN_LAYER`: FSDP2's
    gathered layers); added to the candidates inside a layer.
    """
    st, layer_terms, prof = _step(scn, layer_resident)
    full = not scn.lora
    head_grad = (
        4 * st.shape.vocab_size * st.shape.hidden_size if full and not prof.grads_leave_autograd else 0
    )
    moments = [*_loss_moments(st), *_last_layer_moments(st, head_grad)]
    if st.n_ckpt:
        moments.append(_recompute_moment(st))
    if st.n_saved:
        moments.extend(_forward_moments(st, _bool_mask(scn)))
    if scn.reference_forward:
        moments.extend(_reference_moments(st, _bool_mask(scn)))
    peak = max(moments, key=lambda m: m.total)
    return ActivationTerms(
        peak=peak.total,
        terms=peak.terms,
        where=peak.where,
        per_layer_token_terms=tuple(layer_terms),
        moments=tuple(moments),
        host=_host_terms(st),
    )


def _reference_moments(st: _Step, bool_mask: int) -> list[Moment]:
    """DPO's reference with the adapters off (`preference.reference: adapters_off`): before the policy's
    forward, the same rows through the frozen base under no_grad. Nothing is saved (and autocast caches no
    copy of a frozen weight), so inside a layer it holds the residual stream, the masks, that layer's
    working set and sdpa's additive mask of the call; then the logits and the loss's forward temporaries
    (unchunked: the fp32 copy and the log-probabilities; fused_linear: the hidden states and one chunk).
    Only the rows' summed log-probs outlive it (a few bytes)."""
    scn, h, tokens, resid = st.scn, st.shape.hidden_size, st.tokens, st.dt.resid
    rope = 2 * scn.seq_len * st.shape.head_dim * resid
    additive = st.dt.att * scn.seq_len * tokens if bool_mask else 0  # sdpa's per-call float mask
    layer = (
        Term(
            TermKind.REFERENCE_FORWARD,
            resid * h * tokens + bool_mask + rope + additive,
            f"reference forward: residual stream ({tokens} tokens), padding masks, rotary",
        ),
        Term(
            TermKind.REFERENCE_FORWARD,
            st.tr.forward_extra * tokens,
            "reference forward: one layer's working set (no grad: nothing saved)",
        ),
    )
    return [
        Moment("reference forward (adapters off, no grad): a decoder layer", (*layer, *st.in_layer)),
        Moment("reference forward (adapters off, no grad): its log-probs", _reference_loss_terms(st)),
    ]


def _reference_loss_terms(st: _Step) -> tuple[Term, ...]:
    """The reference's log-probs: the loss's forward temporaries on its logits (see `_reference_moments`)."""
    ce_tokens = st.scn.rows * (st.scn.seq_len - 1)
    if st.scn.cross_entropy == "unchunked":
        fp32 = Term(
            TermKind.REFERENCE_FORWARD,
            8 * st.shape.vocab_size * ce_tokens,
            "reference log-softmax: the fp32 logits and log-probabilities",
        )
        return (*st.logits, fp32)
    forward = _loss_terms(st, ce_tokens)[-1][1]  # the loss's forward moment (its last candidate)
    terms = [Term(TermKind.REFERENCE_FORWARD, t.bytes, f"reference {t.label}") for t in forward]
    if st.scn.cross_entropy == "fused_linear":
        hidden = st.dt.resid * st.shape.hidden_size * st.tokens
        terms.append(Term(TermKind.REFERENCE_FORWARD, hidden, "reference forward: final hidden states"))
    return tuple(terms)


def _host_terms(st: _Step) -> tuple[Term, ...]:
    """Offloaded checkpointed inputs: every checkpointed layer's input in pinned host memory."""
    if not (st.scn.activation_offload and st.n_ckpt):
        return ()
    row = st.dt.resid * st.shape.hidden_size
    label = (
        f"offloaded checkpointed layer inputs ({st.n_ckpt} layers x {st.tokens} tokens x {row:,} B, pinned)"
    )
    return (Term(TermKind.OFFLOADED_INPUTS, st.n_ckpt * row * st.tokens, label),)
