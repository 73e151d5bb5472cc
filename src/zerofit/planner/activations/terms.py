"""What an activation-side memory term is: its kind (`TermKind`), bytes and label (`Term`), the moment
of the step it is alive at (`Moment`), and the peak's result (`ActivationTerms`).

Code selects terms by kind, never by label; `SAVED_FOR_BACKWARD` says which kinds autograd keeps until
backward (what `saved_tensors_hooks` sees) and which are one moment's working set.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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
    # Long-context levers.
    TILED_MLP_INPUT = "tiled MLP saved input"  # per token, a tiled layer keeps its MLP's input only
    MLP_SHARD = "MLP shard"  # one token shard's MLP intermediates and gradients (tiled MLP backward)
    MLP_INPUT_GRAD = "MLP input gradient"  # the tiled MLP's full-size input-gradient buffer
    OFFLOADED_INPUTS = "offloaded checkpointed inputs"  # host RAM (pinned), not the GPU
    FUSED_LOSS_TEMPORARY = "fused loss temporary"  # fused_linear: one chunk's logits work + weight cast
    FUSED_HEAD_GRAD = "fused loss head weight gradient"  # fused_linear, trainable head
    # Preference tuning: DPO's reference forward with the adapters off, under no_grad.
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


def without(terms: tuple[Term, ...] | list[Term], *kinds: TermKind) -> list[Term]:
    """`terms` less those of the given kinds."""
    return [t for t in terms if t.kind not in kinds]


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
