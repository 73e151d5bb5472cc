"""The mixture-of-experts MLP of a decoder layer, read from a config.json dict alone
(`zerofit.catalogue.layouts`): its modules in transformers' registration order and its routed-expert facts.

Qwen2-MoE (Qwen1.5-MoE) as transformers 5 builds it: a router (`mlp.gate`, experts x hidden), every routed
expert of the layer fused into two 3-D parameters (`mlp.experts.gate_up_proj`: experts x 2*ffn x hidden,
`mlp.experts.down_proj`: experts x hidden x ffn), a shared expert (a SwiGLU MLP of its own width) and its
one-output gate. A config whose layers are not all sparse (`mlp_only_layers`, `decoder_sparse_step` > 1) is
left undecided: the planner counts one layer for all of them.

Pure (no torch, no transformers): the catalogue's layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerofit.catalogue.layout_parts import Part, Undecided, need

__all__ = ["qwen2_moe_mlp"]


def qwen2_moe_mlp(config: Mapping[str, Any], hidden: int) -> tuple[list[Part], dict[str, int]]:
    """A Qwen2-MoE layer's MLP parts (names relative to the layer) and its `Layout` expert fields."""
    if config.get("mlp_only_layers", []) != [] or config.get("decoder_sparse_step", 1) != 1:
        raise Undecided("mlp_only_layers")  # some layers dense: one layer is not every layer
    experts, ffn = int(need(config, "num_experts")), int(need(config, "moe_intermediate_size"))
    shared, per_token = (
        int(need(config, "shared_expert_intermediate_size")),
        int(need(config, "num_experts_per_tok")),
    )
    if experts <= 0 or shared <= 0:
        raise Undecided("num_experts")
    parts = [
        Part("mlp.gate", "tensor", hidden, experts),
        Part("mlp.experts.gate_up_proj", "tensor", hidden, experts * 2 * ffn),
        Part("mlp.experts.down_proj", "tensor", ffn, experts * hidden),
        Part("mlp.shared_expert.gate_proj", "linear", hidden, shared),
        Part("mlp.shared_expert.up_proj", "linear", hidden, shared),
        Part("mlp.shared_expert.down_proj", "linear", shared, hidden),
        Part("mlp.shared_expert_gate", "linear", hidden, 1),
    ]
    fields = {
        "num_experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate_size": ffn,
        "shared_expert_intermediate_size": shared,
        "layer_expert_params": sum(n for part in parts[1:3] for n in part.numels),
    }
    return parts, fields
