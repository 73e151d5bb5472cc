"""The mixture-of-experts MLP of a decoder layer, read from a config.json dict alone
(`zerofit.catalogue.layouts`): its modules in transformers' registration order and its routed-expert facts.

As transformers 5 builds them, a layer's routed experts are fused into two 3-D parameters
(`mlp.experts.gate_up_proj`: experts x 2*ffn x hidden, `mlp.experts.down_proj`: experts x hidden x ffn) beside
a router (`mlp.gate`, experts x hidden). Mixtral registers the router first, its experts `intermediate_size`
wide; Qwen3-MoE the experts first, `moe_intermediate_size` wide; Qwen2-MoE (Qwen1.5-MoE) the router first, then
the experts, a shared expert (a SwiGLU MLP of its own width) and its one-output gate. A Qwen-MoE config whose
layers are not all sparse (`mlp_only_layers`, `decoder_sparse_step` > 1) is left undecided: the planner
counts one layer for all of them.

Pure (no torch, no transformers): the catalogue's layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerofit.catalogue.layout_parts import Part, Undecided, need

__all__ = ["mixtral_mlp", "qwen2_moe_mlp", "qwen3_moe_mlp"]


def _all_sparse(config: Mapping[str, Any]) -> None:
    """Undecided unless every layer is sparse (Qwen-MoE's `mlp_only_layers`, `decoder_sparse_step`): the
    planner counts one layer for all of them."""
    if config.get("mlp_only_layers", []) != [] or config.get("decoder_sparse_step", 1) != 1:
        raise Undecided("mlp_only_layers")


def _routed(hidden: int, experts: int, ffn: int, router_first: bool) -> list[Part]:
    """The router (experts x hidden) and the routed experts' two fused 3-D weights, in the family's order."""
    if experts <= 0 or ffn <= 0:
        raise Undecided("num_experts")
    router = [Part("mlp.gate", "tensor", hidden, experts)]
    fused = [
        Part("mlp.experts.gate_up_proj", "tensor", hidden, experts * 2 * ffn),
        Part("mlp.experts.down_proj", "tensor", ffn, experts * hidden),
    ]
    return router + fused if router_first else fused + router


def _fields(experts: int, per_token: int, ffn: int, shared: int, hidden: int) -> dict[str, int]:
    """A mixture of experts' `Layout` fields (the experts module's parameters: its two fused weights)."""
    return {
        "num_experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate_size": ffn,
        "shared_expert_intermediate_size": shared,
        "layer_expert_params": experts * 2 * ffn * hidden + experts * hidden * ffn,
    }


def qwen2_moe_mlp(config: Mapping[str, Any], hidden: int) -> tuple[list[Part], dict[str, int]]:
    """A Qwen2-MoE layer's MLP parts (names relative to the layer) and its `Layout` expert fields: router,
    routed experts, shared expert, shared expert gate."""
    _all_sparse(config)
    experts, ffn = int(need(config, "num_experts")), int(need(config, "moe_intermediate_size"))
    shared, per_token = (
        int(need(config, "shared_expert_intermediate_size")),
        int(need(config, "num_experts_per_tok")),
    )
    if shared <= 0:
        raise Undecided("shared_expert_intermediate_size")
    parts = [
        *_routed(hidden, experts, ffn, router_first=True),
        Part("mlp.shared_expert.gate_proj", "linear", hidden, shared),
        Part("mlp.shared_expert.up_proj", "linear", hidden, shared),
        Part("mlp.shared_expert.down_proj", "linear", shared, hidden),
        Part("mlp.shared_expert_gate", "linear", hidden, 1),
    ]
    return parts, _fields(experts, per_token, ffn, shared, hidden)


def qwen3_moe_mlp(config: Mapping[str, Any], hidden: int) -> tuple[list[Part], dict[str, int]]:
    """A Qwen3-MoE layer's MLP: the routed experts, then the router (no shared expert)."""
    _all_sparse(config)
    experts, ffn = int(need(config, "num_experts")), int(need(config, "moe_intermediate_size"))
    per_token = int(need(config, "num_experts_per_tok"))
    return _routed(hidden, experts, ffn, router_first=False), _fields(experts, per_token, ffn, 0, hidden)


def mixtral_mlp(config: Mapping[str, Any], hidden: int) -> tuple[list[Part], dict[str, int]]:
    """A Mixtral layer's MLP: the router, then the routed experts, each `intermediate_size` wide."""
    experts, ffn = int(need(config, "num_local_experts")), int(need(config, "intermediate_size"))
    per_token = int(need(config, "num_experts_per_tok"))
    return _routed(hidden, experts, ffn, router_first=True), _fields(experts, per_token, ffn, 0, hidden)
