"""The pieces of a model layout read from a config.json dict (`zerofit.catalogue.layouts`): a parameter-
bearing module (`Part`), the whole layout (`Layout`), and how a rule says it cannot answer exactly.

Pure (no torch, no transformers): the catalogue's layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "Part", "Undecided", "need"]


class Undecided(Exception):
    """The rule cannot answer exactly for this config (the meta-device build does)."""


def need(config: Mapping[str, Any], key: str) -> Any:
    """`config[key]`, or undecided when absent (its class default is not this rule's to guess)."""
    if key not in config:
        raise Undecided(key)
    return config[key]


@dataclass(frozen=True)
class Part:
    """One module that holds parameters: its name (relative to a decoder layer, or full outside the layers),
    its kind (`linear`, `norm`, `embedding`, or `tensor`: one parameter that is no linear's, e.g. a router's
    weight, a mixture of experts' fused 3-D weights, a patch embedding's convolution, of in x out elements)
    and sizes (a norm's width is `out_features`, an embedding is vocab x hidden as `in_features` x
    `out_features`); `vision`: part of a vision-language model's vision tower or projector."""

    name: str
    kind: str
    in_features: int
    out_features: int
    bias: bool = False
    vision: bool = False

    @property
    def numels(self) -> tuple[int, ...]:
        """Element count of each of its parameters, in registration order (weight, then bias)."""
        bias = (self.out_features,) if self.bias else ()
        if self.kind == "norm":
            return (self.out_features, *bias)
        return (self.in_features * self.out_features, *bias)


@dataclass(frozen=True)
class Layout:
    """A decoder-only language model's (or a vision-language model's language model's) dimensions and
    parameter-bearing modules, as transformers registers them; a mixture of experts' routed-expert facts (0
    experts: dense) and the FSDP block class(es)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    layer: tuple[Part, ...]  # one decoder layer's modules, in registration order
    outside: tuple[Part, ...]  # the vision tower, the embeddings, the final norm and (untied) the head
    sliding_window: int
    sliding_layers: int
    attn_logit_softcapping: float
    final_logit_softcapping: float
    block_class: str = ""  # what FSDP shards one by one (comma-joined for a vision-language model)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    layer_expert_params: int = 0
    layers_prefix: str = "model.layers."
