"""The loss's temporaries by `train.cross_entropy` (`zerofit.token_loss.sums`): unchunked (fp32 log-probabilities and
two fp32 gradients), chunked (a gradient in the logits' dtype and one fp32 chunk), Liger, the fused linear
loss (`zerofit.token_loss.fused`), and final logit soft-capping (Gemma 2); the loss's moments on top of all saved.
"""

from __future__ import annotations

from zerofit.planner.activations.norms import norm_saves
from zerofit.planner.activations.step import Step
from zerofit.planner.activations.terms import Moment, Term, TermKind
from zerofit.planner.state import dtype_label
from zerofit.token_loss.sums import chunk_tokens


def loss_terms(st: Step, ce_tokens: int) -> list[tuple[str, list[Term]]]:
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


def _fused_loss_terms(st: Step, per_token: Term) -> list[tuple[str, list[Term]]]:
    """`fused_linear` (zerofit.token_loss.fused): no logits; one chunk of C tokens x vocab at a time (C V 4 =
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


def loss_moments(st: Step) -> list[Moment]:
    """The loss's peaks on top of everything saved (the final norm's and lm_head's inputs included)."""
    h, tokens, full = st.shape.hidden_size, st.tokens, not st.scn.lora
    final_norm = norm_saves(st.scn, h, st.dt) * tokens
    head_input = 0
    if full:
        ac = st.dt.autocast_half
        head_input = (ac if ac and st.dt.resid != ac else st.dt.resid) * h * tokens
    if st.scn.cross_entropy == "fused_linear":
        head_input = st.dt.resid * h * tokens  # the fused function saves the hidden states as they are
    head = Term(TermKind.HEAD_INPUTS, final_norm + head_input + st.ids, "final norm + lm_head saved inputs")
    ce_tokens = st.scn.rows * (st.scn.seq_len - 1)
    capped = _softcap_terms(st)
    return [Moment(where, (*st.base, head, *capped, *terms)) for where, terms in loss_terms(st, ce_tokens)]


def _softcap_terms(st: Step) -> tuple[Term, ...]:
    """Final logit soft-capping (Gemma 2): cap * tanh(logits / cap) keeps the tanh's output, one more
    logits-sized tensor, until the loss's backward has passed through it."""
    cap = st.shape.final_logit_softcapping
    if not cap or st.scn.cross_entropy == "fused_linear" or not st.logits:
        return ()
    label = f"final logit soft-capping: tanh output (cap {cap:g}), saved"
    return (Term(TermKind.LOGITS_SOFTCAP, st.logits[0].bytes, label),)
