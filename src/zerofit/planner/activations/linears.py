"""What the linears of a decoder layer save for backward per token: a base linear's input only when its
weight trains; a LoRA adapter its own input (shared with the base's when the dtypes agree, else a cast
copy), the rank-r output of A and a dropout mask.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerofit.planner.activations.attention import attention_output_is_saved
from zerofit.planner.activations.dtypes import LayerDtypes
from zerofit.planner.activations.terms import Term, TermKind
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import LoraShape, ModelShape

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
    acc: _LinearSaves, scn: Scenario, dt: LayerDtypes, group: str, width: int, x_b: int, lora_r: int | None
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


def linear_input_saves(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: LayerDtypes, skip_mlp: bool = False
) -> tuple[list[Term], int]:
    """The linears' saved inputs per token, as terms, and the part of them after attention (`skip_mlp`:
    without the MLP's linears, which a tiled MLP runs without saving)."""
    h = shape.hidden_size
    # Linear inputs, by the tensor they read: (width, dtype of that tensor, already saved by attention).
    groups = {
        "attn_in": (h, dt.resid, False),
        # o_proj reads the attention output the kernel saved, except the per-document sdpa's, which is a
        # concatenation of the documents' outputs (a copy of its own).
        "o_in": (shape.q_dim, dt.att, attention_output_is_saved(scn)),
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
