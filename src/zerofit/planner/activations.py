"""Activations at the forward/backward peak: saved tensors per layer and token, logits, loss temporaries.

Activation bytes per token of one decoder layer are a sum of named terms (see `_layer_split`). The rules
come from which tensors autograd saves for backward:
  - RMSNorm saves its fp32 upcast input and the per-token rstd (and its normalized output when its weight
    trains);
  - a linear saves its input only when its weight trains; a frozen base linear saves nothing, its LoRA
    adapter saves its own input: the same storage as the base's input when the dtypes agree, else its own
    cast copy (fp32 adapters under a bf16 base, or a bf16 copy under autocast), plus the rank-r output of A;
  - attention (sdpa) saves q, k, v, the output and a per-head logsumexp; eager attention also keeps the
    S x S probabilities (fp32 softmax output and its half copy);
  - SwiGLU saves gate and up outputs and the activation's output;
  - dropout keeps a one-byte mask per element (CUDA).

Selective checkpointing (the first n of L layers recomputed) keeps n layer inputs and L - n layers of saved
tensors; the loss's temporaries depend on `train.cross_entropy` (`zerofit.loss`): unchunked holds fp32
log-probabilities and two fp32 (tokens x vocab) gradients, chunked a gradient in the logits' dtype and one
fp32 chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerofit.loss import chunk_tokens
from zerofit.planner.scenario import ComputeProfile, Scenario, compute_profile
from zerofit.planner.shapes import LoraShape, ModelShape, lora_shape, model_shape
from zerofit.planner.state import ParamCounts, dtype_label, param_counts
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
    half_b = dtype_bytes(prof.half) if prof.half else 4
    if prof.cast_params_to is not None:
        store = half_b  # DeepSpeed / FSDP2: everything computes in the half dtype
        adapter = half_b
    else:
        store = 4 if (scn.quantization != "none" or prof.load == "fp32") else dtype_bytes(prof.load)
        adapter = 4
    resid = store
    ac = half_b if prof.autocast else None
    # bitsandbytes returns its output in the input's dtype; otherwise autocast or the weights decide.
    lin_out = resid if scn.quantization != "none" else (ac or store)
    att = ac or lin_out
    logits = ac or store
    return _Dt(resid=resid, lin_out=lin_out, att=att, logits=logits, adapter=adapter, autocast_half=ac)


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


def _layer_split(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt
) -> tuple[list[tuple[str, int]], int]:
    """Bytes saved for backward per token by one decoder layer, as named terms, plus how many of those
    bytes belong after attention (o_proj, norm 2, the MLP)."""
    h, inter = shape.hidden_size, shape.intermediate_size
    q_dim, kv_dim, heads = shape.q_dim, shape.kv_dim, shape.num_heads
    full = not scn.lora
    terms: list[tuple[str, int]] = []
    # RMSNorm x2: fp32 upcast input + rstd; normalized output too when the norm weight trains.
    norm = 4 * h + 4 + (dt.resid * h if full else 0)
    terms.append(("2 RMSNorms (fp32 input, rstd" + (", normalized output)" if full else ")"), 2 * norm))

    masked = scn.masked_attention  # padded micro-batches of >1 sequence, or packed rows: masked attention
    kv_saved = q_dim if (masked or scn.attn_implementation == "eager") else kv_dim
    if scn.attn_implementation == "eager":
        s = scn.seq_len
        attn = dt.att * (q_dim + 2 * kv_saved) + 4 * heads * s + dt.att * heads * s
        terms.append(
            (f"eager attention: q, k and v (repeated to all heads), fp32 softmax + probs (S={s})", attn)
        )
    else:
        attn = dt.att * (2 * q_dim + 2 * kv_saved) + 4 * heads
        terms.append(("sdpa attention: q, k, v, output, logsumexp", attn))
        if masked:
            # sdpa converts the boolean padding mask to an additive one per call and keeps it for backward.
            terms.append((f"sdpa additive padding mask (S={scn.seq_len})", dt.att * scn.seq_len))
    # SwiGLU: gate output (activation input), activation output, up output.
    mlp_b = dt.lin_out
    swiglu = 3 * mlp_b * inter
    terms.append(("SwiGLU: gate, act(gate), up outputs", swiglu))
    post_attention = norm + swiglu

    # Linear inputs, by the tensor they read: (width, dtype of that tensor, already saved by attention).
    groups = {
        "attn_in": (h, dt.resid, False),
        "o_in": (q_dim, dt.att, scn.attn_implementation == "sdpa"),
        "mlp_in": (h, dt.resid, False),
        "down_in": (inter, mlp_b, False),
    }
    shared_saved: set[str] = set()
    own_copies = lora_rank_io = dropout_masks = 0
    targets = {t.name.rpartition(".")[2] for t in (lora.layer_targets if lora else ())}
    ac = dt.autocast_half
    for lin in shape.linears:
        short = lin.name.rpartition(".")[2]
        group = _GROUP_OF.get(short, lin.name)
        width, x_b, _ = groups.get(group, (lin.in_features, dt.resid, False))
        before = own_copies + lora_rank_io + dropout_masks
        if full:
            if ac is not None and x_b != ac:
                own_copies += ac * width  # autocast casts the input for each linear
            else:
                shared_saved.add(group)
        if short in targets and lora is not None:
            if scn.lora_dropout > 0:
                dropout_masks += width
                # dropout output in the adapter dtype; under autocast A saves a half copy of it instead
                own_copies += (ac or dt.adapter) * width
            elif ac is not None:
                if x_b != ac or dt.adapter != ac:
                    own_copies += ac * width
                else:
                    shared_saved.add(group)
            elif x_b != dt.adapter:
                own_copies += dt.adapter * width  # peft casts the input to the adapter dtype
            else:
                shared_saved.add(group)
            lora_rank_io += (ac or dt.adapter) * lora.r
        if group in _POST_ATTENTION_GROUPS:
            post_attention += own_copies + lora_rank_io + dropout_masks - before
    counted = [g for g in shared_saved if g in groups and not groups[g][2]]
    shared = sum(groups[g][0] * groups[g][1] for g in counted)
    post_attention += sum(groups[g][0] * groups[g][1] for g in counted if g in _POST_ATTENTION_GROUPS)
    if shared:
        terms.append(("linear inputs shared by the projections reading them", shared))
    if own_copies:
        terms.append(("per-linear input copies (dtype casts / dropout outputs)", own_copies))
    if lora_rank_io:
        terms.append((f"LoRA A outputs (rank {lora.r if lora else 0})", lora_rank_io))
    if dropout_masks:
        terms.append(("LoRA dropout masks (1 byte)", dropout_masks))
    return terms, post_attention


@dataclass
class ActivationTerms:
    """Activation-side bytes at the forward/backward peak, with named lines (bytes)."""

    peak: int
    lines: dict[str, int]
    where: str  # which moment of the step is the peak
    per_layer_token_terms: list[tuple[str, int]]


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
    head_fp32 = not scn.lora or scn.quantization != "none"  # full fine-tuning or k-bit prepared head
    if head_fp32:
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


def _loss_candidates(
    scn: Scenario,
    dt: _Dt,
    logits_key: str,
    logits: int,
    tokens: int,
    ce_tokens: int,
    vocab: int,
    half: str | None,
) -> list[tuple[str, dict[str, int]]]:
    """The loss's own peaks (forward and backward of the cross-entropy), lines besides the saved tensors."""
    if scn.cross_entropy == "unchunked":
        return [
            (
                "loss backward (cross-entropy's fp32 gradients)",
                {
                    logits_key: logits,
                    "log-probabilities (fp32) + targets": 4 * vocab * ce_tokens + 8 * ce_tokens,
                    "cross-entropy backward: 2 fp32 (tokens x vocab) gradients": 8 * vocab * ce_tokens,
                },
            )
        ]
    per_token = {"cross-entropy: per-token log-sum-exp (fp32) + targets": 12 * tokens}
    if scn.cross_entropy == "liger":
        # Liger computes the gradient in forward, into the logits' own storage.
        return [
            ("loss (Liger cross-entropy, gradient in the logits' storage)", {logits_key: logits, **per_token})
        ]
    chunk = min(chunk_tokens(vocab), tokens)
    upcasts = 1 if dt.logits == 4 else 2  # the fp32 copy of the chunk (none for fp32 logits) + logsumexp's
    return [
        (
            "loss backward (chunked cross-entropy)",
            {
                logits_key: logits,
                f"chunked cross-entropy: logits gradient ({dtype_label(dt.logits, half)}, {tokens} x {vocab:,})": (
                    dt.logits * vocab * tokens
                ),
                f"chunked cross-entropy: one fp32 chunk ({chunk} tokens x {vocab:,})": 4 * vocab * chunk,
                **per_token,
            },
        ),
        (
            "loss forward (chunked cross-entropy)",
            {
                logits_key: logits,
                f"chunked cross-entropy: fp32 chunk + logsumexp temporary ({chunk} tokens x {vocab:,})": (
                    upcasts * 4 * vocab * chunk
                ),
                **per_token,
            },
        ),
    ]


def activation_terms(scn: Scenario, layer_resident: dict[str, int] | None = None) -> ActivationTerms:
    """Activations, logits and loss temporaries at the forward/backward peak (bytes, per rank).

    With n of L decoder layers checkpointed (the first n), the candidates (the largest is the peak):
      - end of forward (n < L): n layer inputs + L - n layers' saved tensors + the last layer's live set;
      - the loss (forward and backward of the cross-entropy, see `_loss_candidates`), on top of all saved;
      - backward of the last layer (recomputed when n = L): its saved tensors + the gradients in flight
        around its down projection, with the logits still held by the training loop;
      - recomputation of layer n - 1 in backward (n > 0): the n checkpointed inputs (the layers above have
        released theirs) + the recomputed layer + the gradients waiting at its output.
    `layer_resident`: bytes that exist only while a decoder layer runs (FSDP2's gathered layers); added to
    the candidates inside a layer.
    """
    prof = compute_profile(scn)
    shape = model_shape(scn.model)
    lora = lora_shape(scn.model, scn.lora_r, scn.lora_targets, scn.use_dora) if scn.lora else None
    counts = param_counts(scn)
    dt = _dtypes(scn, prof)
    b, s = scn.micro_batch_size, scn.seq_len
    tokens, ce_tokens = b * s, b * (s - 1)
    h, v, n_layers = shape.hidden_size, shape.vocab_size, shape.num_layers
    full = not scn.lora
    n_ckpt = scn.checkpointed(n_layers)
    n_saved = n_layers - n_ckpt
    in_layer = dict(layer_resident or {})

    terms, post_attention_tok = _layer_split(scn, shape, lora, dt)
    per_layer_tok = sum(n for _, n in terms)
    tr = _transients(scn, shape, lora, dt)
    # Under LoRA nothing before layer 0's first adapter needs a gradient: its first RMSNorm saves nothing.
    layer0_saving = 0 if (full or n_ckpt) else 4 * h + 4

    # Shared by all layers: rotary cos/sin (one sequence wide). The boolean padding mask (B x 1 x S x S)
    # lives through the forward; under checkpointing every layer keeps it as an input until backward.
    rope = 2 * s * shape.head_dim * dt.resid
    bool_mask = b * s * s if (scn.masked_attention and scn.attn_implementation == "sdpa") else 0
    ckpt_inputs: dict[str, int] = {}
    if n_ckpt:
        ckpt_inputs[f"checkpointed layer inputs ({n_ckpt} layers x {tokens} tokens x {dt.resid * h:,} B)"] = (
            n_ckpt * dt.resid * h * tokens
        )
        ckpt_inputs["rotary cos/sin + boolean padding mask (kept by the checkpoints)"] = rope + bool_mask
    else:
        ckpt_inputs["rotary cos/sin"] = rope
    saved: dict[str, int] = {}
    if n_saved:
        saved[f"saved activations ({n_saved} layers x {tokens} tokens x {per_layer_tok:,} B)"] = (
            n_saved * per_layer_tok - layer0_saving
        ) * tokens
    base: dict[str, int] = {}
    copies = _autocast_weight_copies(scn, shape, counts, dt)
    if copies:
        base["autocast half copies of fp32 matmul weights"] = copies
    base.update(ckpt_inputs)
    base.update(saved)

    final_norm = (4 * h + 4 + (dt.resid * h if full else 0)) * tokens
    head_input = 0
    ids = 8 * tokens if full else 0  # the embedding's backward keeps the input ids
    if full:
        ac = dt.autocast_half
        head_input = (ac if ac and dt.resid != ac else dt.resid) * h * tokens
    logits_key = f"logits ({dtype_label(dt.logits, prof.half)}, {tokens} x {v:,}), held by the training loop"
    logits = dt.logits * v * tokens
    head_grad = 4 * v * h if full and not prof.grads_leave_autograd else 0

    candidates: list[tuple[str, dict[str, int]]] = []
    for where, lines in _loss_candidates(scn, dt, logits_key, logits, tokens, ce_tokens, v, prof.half):
        candidates.append(
            (where, {**base, "final norm + lm_head saved inputs": final_norm + head_input + ids, **lines})
        )

    last_layer = {**base, logits_key: logits}
    if ids:
        last_layer["input ids (embedding backward)"] = ids
    # A recomputed layer's first RMSNorm saves its input; in fp32 that is the checkpointed input itself.
    recomputed_tok = per_layer_tok - (4 * h if dt.resid == 4 else 0)
    recomputed = f"recomputed last layer ({tokens} tokens x {recomputed_tok:,} B)"
    last_recomputed = n_saved == 0
    if last_recomputed:
        last_layer[recomputed] = recomputed_tok * tokens
    last_layer["gradients in flight at its down projection"] = tr.backward_extra * tokens
    if head_grad:
        last_layer["lm_head weight gradient (fp32)"] = head_grad
    last_layer.update(in_layer)
    candidates.append(
        ("backward of the last layer" + (" (recomputed)" if last_recomputed else ""), last_layer)
    )
    if scn.attn_implementation == "eager":
        # Eager attention's backward: the fp32 gradient of the softmax output and the softmax backward's
        # fp32 result (both heads x S wide per token) while the half probabilities are already released.
        # Everything the layer saved after attention has been released by then.
        att_bwd = {k: n for k, n in last_layer.items() if k != "gradients in flight at its down projection"}
        if last_recomputed:
            att_bwd[recomputed] -= post_attention_tok * tokens
        att_bwd["eager attention backward: 2 fp32 (heads x S) gradients, later saves released"] = (
            (8 - dt.att) * shape.num_heads * s + dt.resid * h - (0 if last_recomputed else post_attention_tok)
        ) * tokens
        candidates.append(("eager attention backward of the last layer", att_bwd))
    live = {"live tensors around the last layer's down projection": tr.forward_extra * tokens}
    if ids:
        live["input ids (embedding backward)"] = ids
    if n_ckpt:
        # The recomputation inside backward runs the top checkpointed layer's forward again with the logits
        # still held; the saved tensors of the layers above it are already released.
        top = "the last layer" if last_recomputed else f"layer {n_ckpt - 1} (the last checkpointed)"
        recompute = {
            **{k: n for k, n in base.items() if k not in saved},
            logits_key: logits,
            (recomputed if last_recomputed else recomputed.replace("last layer", f"layer {n_ckpt - 1}")): (
                recomputed_tok * tokens
            ),
            **live,
        }
        recompute["gradients waiting at the layer's output"] = tr.incoming_grads * tokens
        recompute.update(in_layer)
        candidates.append((f"recomputation of {top} in backward", recompute))
    if n_saved:
        # Forward keeps the embedding output (the model's local) and the boolean mask alive throughout
        # (under checkpointing both are already counted: layer 0's checkpointed input, the checkpoints' mask).
        fwd_common = (
            {}
            if n_ckpt
            else {"embedding output + boolean padding mask (forward only)": dt.resid * h * tokens + bool_mask}
        )
        candidates.append(
            ("end of forward (last layer's down projection)", {**base, **fwd_common, **live, **in_layer})
        )
        # The final RMSNorm: its input, fp32 upcast (saved; the input itself when already fp32) and rstd,
        # the fp32 product, and two results in the residual dtype.
        upcast = 4 * h if dt.resid != 4 else 0
        final_norm_fwd = (3 * dt.resid * h + upcast + 4 * h + 8) * tokens
        candidates.append(
            ("end of forward (final norm)", {**base, **fwd_common, "final norm forward": final_norm_fwd})
        )
    where, lines = max(candidates, key=lambda c: sum(c[1].values()))
    return ActivationTerms(peak=sum(lines.values()), lines=lines, where=where, per_layer_token_terms=terms)
