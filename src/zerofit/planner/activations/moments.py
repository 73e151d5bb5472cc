"""The candidate moments of a step besides the loss's: the last layer's backward (and eager attention's
softmax backward), the recomputation of the top checkpointed layer, the end of forward, DPO's reference
forward with the adapters off, and the offloaded inputs in host memory.
"""

from __future__ import annotations

from zerofit.planner.activations.loss import loss_terms
from zerofit.planner.activations.step import Step
from zerofit.planner.activations.terms import Moment, Term, TermKind, without


def last_layer_moments(st: Step, head_grad: int) -> list[Moment]:
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


def _eager_attention_backward(st: Step, last_layer: list[Term]) -> Moment:
    """Eager attention's backward: the fp32 gradient of the softmax output and the softmax backward's fp32
    result (both heads x S wide per token) while the half probabilities are already released. Everything
    the layer saved after attention has been released by then."""
    tokens, post = st.tokens, st.post_attention_tok
    terms = without(last_layer, TermKind.GRADS_IN_FLIGHT)
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


def recompute_moment(st: Step) -> Moment:
    """The recomputation inside backward runs the top checkpointed layer's forward again with the logits
    still held; the saved tensors of the layers above it are already released."""
    which = "last layer" if st.last_recomputed else f"layer {st.n_ckpt - 1}"
    top = "the last layer" if st.last_recomputed else f"layer {st.n_ckpt - 1} (the last checkpointed)"
    waiting = Term(
        TermKind.GRADS_WAITING, st.tr.incoming_grads * st.tokens, "gradients waiting at the layer's output"
    )
    terms = (
        *without(st.base, TermKind.SAVED_LAYERS),
        *st.logits,
        st.recomputed(which),
        *st.live(),
        waiting,
        *st.in_layer,
    )
    return Moment(f"recomputation of {top} in backward", terms)


def forward_moments(st: Step, bool_mask: int) -> list[Moment]:
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


def reference_moments(st: Step, bool_mask: int) -> list[Moment]:
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


def _reference_loss_terms(st: Step) -> tuple[Term, ...]:
    """The reference's log-probs: the loss's forward temporaries on its logits (see `reference_moments`)."""
    ce_tokens = st.scn.rows * (st.scn.seq_len - 1)
    if st.scn.cross_entropy == "unchunked":
        fp32 = Term(
            TermKind.REFERENCE_FORWARD,
            8 * st.shape.vocab_size * ce_tokens,
            "reference log-softmax: the fp32 logits and log-probabilities",
        )
        return (*st.logits, fp32)
    forward = loss_terms(st, ce_tokens)[-1][1]  # the loss's forward moment (its last candidate)
    terms = [Term(TermKind.REFERENCE_FORWARD, t.bytes, f"reference {t.label}") for t in forward]
    if st.scn.cross_entropy == "fused_linear":
        hidden = st.dt.resid * st.shape.hidden_size * st.tokens
        terms.append(Term(TermKind.REFERENCE_FORWARD, hidden, "reference forward: final hidden states"))
    return tuple(terms)


def host_terms(st: Step) -> tuple[Term, ...]:
    """Offloaded checkpointed inputs: every checkpointed layer's input in pinned host memory."""
    if not (st.scn.activation_offload and st.n_ckpt):
        return ()
    row = st.dt.resid * st.shape.hidden_size
    label = (
        f"offloaded checkpointed layer inputs ({st.n_ckpt} layers x {st.tokens} tokens x {row:,} B, pinned)"
    )
    return (Term(TermKind.OFFLOADED_INPUTS, st.n_ckpt * row * st.tokens, label),)
