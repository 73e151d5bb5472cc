"""The activation peak of a step: every candidate moment, the largest wins (`activation_terms`)."""

from __future__ import annotations

from collections.abc import Iterable

from zerofit.planner.activations.loss import loss_moments
from zerofit.planner.activations.moments import (
    forward_moments,
    host_terms,
    last_layer_moments,
    recompute_moment,
    reference_moments,
)
from zerofit.planner.activations.step import bool_mask_bytes, step_of
from zerofit.planner.activations.terms import ActivationTerms
from zerofit.planner.scenario import Scenario
from zerofit.planner.state import StateLine


def activation_terms(scn: Scenario, layer_resident: Iterable[StateLine] = ()) -> ActivationTerms:
    """Activations, logits and loss temporaries at the forward/backward peak (bytes, per rank).

    With n of L decoder layers checkpointed (the first n), the candidates (the largest is the peak):
      - end of forward (n < L): n layer inputs + L - n layers' saved tensors + the last layer's live set;
      - the loss (forward and backward of the cross-entropy, see `loss_terms`), on top of all saved;
      - backward of the last layer (recomputed when n = L): its saved tensors + the gradients in flight
        around its down projection, with the logits still held by the training loop;
      - recomputation of layer n - 1 in backward (n > 0): the n checkpointed inputs (the layers above have
        released theirs) + the recomputed layer + the gradients waiting at its output;
      - DPO's reference forward (`preference.reference: adapters_off`): a no-grad forward of the same rows,
        nothing saved (`reference_moments`).
    `layer_resident`: the state lines that exist only while a decoder layer runs (`Place.IN_LAYER`: FSDP2's
    gathered layers); added to the candidates inside a layer.
    """
    st, layer_terms, prof = step_of(scn, layer_resident)
    full = not scn.lora
    head_grad = (
        4 * st.shape.vocab_size * st.shape.hidden_size if full and not prof.grads_leave_autograd else 0
    )
    moments = [*loss_moments(st), *last_layer_moments(st, head_grad)]
    if st.n_ckpt:
        moments.append(recompute_moment(st))
    if st.n_saved:
        moments.extend(forward_moments(st, bool_mask_bytes(scn)))
    if scn.reference_forward:
        moments.extend(reference_moments(st, bool_mask_bytes(scn)))
    peak = max(moments, key=lambda m: m.total)
    return ActivationTerms(
        peak=peak.total,
        terms=peak.terms,
        where=peak.where,
        per_layer_token_terms=tuple(layer_terms),
        moments=tuple(moments),
        host=host_terms(st),
    )
