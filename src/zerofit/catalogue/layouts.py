"""The parameter layout of a dense decoder-only language model, read from its config.json dict alone.

`zerofit plan` needs a model's shapes, its LoRA counts and its FSDP block class. A meta-device build through
transformers answers them exactly for any architecture, but its imports (transformers' modeling stack, peft)
cost seconds, which a user's first plan of a model would pay. For the dense families zerofit maps
(`zerofit.models.lora_targets`), the layout is a short rule of the config: which linear layers and norms a
decoder layer registers, in order, their sizes and biases; the embeddings, final norm and head outside the
layers; the sliding window and soft-capping the config class derives. `model_layout` answers None for
anything the rule cannot decide exactly (another family, a vision-language model, a key whose default this
rule does not know, a setting that changes the layout): the caller then builds the model on the meta device,
as before. `tests/unit/planner/test_config_layout.py` holds every answer equal to the meta build's.

Pure (no torch, no transformers): the catalogue's layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "Part", "layer_class_by_convention", "layout_model_types", "model_layout"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS2 = ("input_layernorm", "post_attention_layernorm")
_NORMS4 = (*_NORMS2, "pre_feedforward_layernorm", "post_feedforward_layernorm")


class _Undecided(Exception):
    """The rule cannot answer exactly for this config (the meta-device build does)."""


@dataclass(frozen=True)
class Part:
    """One module that holds parameters: its name (relative to a decoder layer, or full outside the layers),
    its kind (`linear`, `norm`, `embedding`) and sizes (a norm's width is `out_features`, an embedding is
    vocab x hidden as `in_features` x `out_features`)."""

    name: str
    kind: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def numels(self) -> tuple[int, ...]:
        """Element count of each of its parameters, in registration order (weight, then bias)."""
        if self.kind == "norm":
            return (self.out_features,)
        return (self.in_features * self.out_features,) + ((self.out_features,) if self.bias else ())


@dataclass(frozen=True)
class Layout:
    """A dense decoder-only model's dimensions and parameter-bearing modules, as transformers registers them."""

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
    outside: tuple[Part, ...]  # the embeddings, the final norm and (untied) the head, by full name
    sliding_window: int
    sliding_layers: int
    attn_logit_softcapping: float
    final_logit_softcapping: float
    layers_prefix: str = "model.layers."


@dataclass(frozen=True)
class _Family:
    """How one family's decoder layer is laid out: its attention and MLP linears in registration order, which
    of them carry a bias (`config`: `attention_bias` on the four attention projections; `qkv`: q, k and v
    always), q/k norms, the layer's norms, whether `head_dim` must be given (its class default is not
    hidden / heads), and its sliding-window and soft-capping rules."""

    attention: tuple[str, ...] = _ATTENTION
    mlp: tuple[str, ...] = _MLP
    bias: str = "config"
    mlp_bias: bool = False  # the MLP's linears follow `mlp_bias` (Llama), else they have none
    qk_norm: bool = False
    norms: tuple[str, ...] = _NORMS2
    head_dim_required: bool = False
    sliding: Callable[[Mapping[str, Any], int], tuple[int, int]] = lambda config, layers: (0, 0)
    softcaps: Callable[[Mapping[str, Any]], tuple[float, float]] = lambda config: (0.0, 0.0)


def _need(config: Mapping[str, Any], key: str) -> Any:
    """`config[key]`, or undecided when absent (its class default is not this rule's to guess)."""
    if key not in config:
        raise _Undecided(key)
    return config[key]


def _every_layer(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """Mistral: the window (given; null: none) on every layer; per-layer types are another class's."""
    if "layer_types" in config:
        raise _Undecided("layer_types")
    window = _need(config, "sliding_window") or 0
    return (window, layers if window else 0)


def _phi3_window(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """Phi-3: an optional window (default none) on every layer."""
    window = config.get("sliding_window") or 0
    return (window, layers if window else 0)


def _qwen_window(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """Qwen2 / Qwen3: no window unless `use_sliding_window` (then undecided: layers past
    `max_window_layers` only)."""
    if config.get("use_sliding_window"):
        raise _Undecided("use_sliding_window")
    return (0, 0)


def _gemma_window(pattern: int | None) -> Callable[[Mapping[str, Any], int], tuple[int, int]]:
    """Gemma 2 (alternating: `pattern` 2) and Gemma 3 (`sliding_window_pattern`, default 6, when `pattern`
    is None): the window and how many layers use it, from `layer_types` when given."""

    def rule(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
        if config.get("use_bidirectional_attention"):
            raise _Undecided("use_bidirectional_attention")
        window = _need(config, "sliding_window") or 0
        types = config.get("layer_types")
        every = pattern or int(config.get("sliding_window_pattern") or 6)
        if not isinstance(types, list):
            types = ["sliding_attention" if (i + 1) % every else "full" for i in range(layers)]
        return (window, sum(t == "sliding_attention" for t in types) if window else 0)

    return rule


def _gemma2_caps(config: Mapping[str, Any]) -> tuple[float, float]:
    """Gemma 2's soft-caps (attention, final logits): given, or undecided."""
    return (_need(config, "attn_logit_softcapping") or 0.0, _need(config, "final_logit_softcapping") or 0.0)


def _gemma3_caps(config: Mapping[str, Any]) -> tuple[float, float]:
    """Gemma 3's soft-caps: none unless given."""
    return (config.get("attn_logit_softcapping") or 0.0, config.get("final_logit_softcapping") or 0.0)


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(mlp_bias=True),
    "mistral": _Family(bias="none", sliding=_every_layer),
    "qwen2": _Family(bias="qkv", sliding=_qwen_window),
    "qwen3": _Family(qk_norm=True, head_dim_required=True, sliding=_qwen_window),
    "gemma2": _Family(norms=_NORMS4, head_dim_required=True, sliding=_gemma_window(2), softcaps=_gemma2_caps),
    "gemma3_text": _Family(
        qk_norm=True,
        norms=_NORMS4,
        head_dim_required=True,
        sliding=_gemma_window(None),
        softcaps=_gemma3_caps,
    ),
    # Phi-3 / Phi-4 register o_proj before the fused qkv_proj.
    "phi3": _Family(
        attention=("o_proj", "qkv_proj"), mlp=("gate_up_proj", "down_proj"), bias="none", sliding=_phi3_window
    ),
}


def layout_model_types() -> tuple[str, ...]:
    """Every `model_type` whose layout this rule reads from the config."""
    return tuple(_FAMILIES)


def layer_class_by_convention(architecture: str) -> str:
    """transformers' naming convention for a causal LM's decoder layer: `<Arch>ForCausalLM` ->
    `<Arch>DecoderLayer` (what FSDP shards one by one)."""
    return architecture.removesuffix("ForCausalLM") + "DecoderLayer"


def model_layout(config: Mapping[str, Any]) -> Layout | None:
    """The layout of the model `config` (a config.json dict) describes; None when the rule cannot decide it
    exactly (the caller builds the model on the meta device instead)."""
    family = _FAMILIES.get(str(config.get("model_type") or ""))
    archs = config.get("architectures")
    if (
        family is None
        or not isinstance(archs, list)
        or len(archs) != 1
        or not str(archs[0]).endswith("ForCausalLM")
        or "vision_config" in config  # a vision-language model: the meta build's
        or "text_config" in config
    ):
        return None
    try:
        return _layout(config, family)
    except (_Undecided, TypeError, ValueError):
        return None


def _attention_biases(config: Mapping[str, Any], family: _Family) -> set[str]:
    """The attention projections that carry a bias; undecided when `attention_bias` is set for a family
    whose biases do not follow it."""
    attention_bias = bool(config.get("attention_bias") or False)
    if family.bias == "config":
        return set(_ATTENTION) if attention_bias else set()
    if attention_bias:
        raise _Undecided("attention_bias")
    return set(_ATTENTION[:3]) if family.bias == "qkv" else set()


def _layout(config: Mapping[str, Any], family: _Family) -> Layout:
    """`model_layout` for a family this rule reads (raises `_Undecided`)."""
    hidden, inter = int(_need(config, "hidden_size")), int(_need(config, "intermediate_size"))
    heads, kv = int(_need(config, "num_attention_heads")), int(_need(config, "num_key_value_heads"))
    layers, vocab = int(_need(config, "num_hidden_layers")), int(_need(config, "vocab_size"))
    head_dim = config.get("head_dim") or (_need(config, "head_dim") if family.head_dim_required else None)
    head_dim = int(head_dim or hidden // heads)
    tied = bool(_need(config, "tie_word_embeddings"))
    q, k = heads * head_dim, kv * head_dim
    sizes = {"q_proj": (hidden, q), "k_proj": (hidden, k), "v_proj": (hidden, k), "o_proj": (q, hidden),
             "qkv_proj": (hidden, q + 2 * k), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
             "down_proj": (inter, hidden), "gate_up_proj": (hidden, 2 * inter)}  # fmt: skip
    attn_bias = _attention_biases(config, family)
    mlp_bias = bool(config.get("mlp_bias") or False)
    if mlp_bias and not family.mlp_bias:
        raise _Undecided("mlp_bias")
    parts = [Part(f"self_attn.{n}", "linear", *sizes[n], n in attn_bias) for n in family.attention]
    if family.qk_norm:
        parts += [
            Part("self_attn.q_norm", "norm", head_dim, head_dim),
            Part("self_attn.k_norm", "norm", head_dim, head_dim),
        ]
    parts += [Part(f"mlp.{n}", "linear", *sizes[n], mlp_bias) for n in family.mlp]
    parts += [Part(n, "norm", hidden, hidden) for n in family.norms]
    outside = [
        Part("model.embed_tokens", "embedding", vocab, hidden),
        Part("model.norm", "norm", hidden, hidden),
    ]
    if not tied:
        outside.append(Part("lm_head", "linear", hidden, vocab))
    window, sliding = family.sliding(config, layers)
    attn_cap, final_cap = family.softcaps(config)
    return Layout(
        model_type=str(config["model_type"]), hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab, tied=tied,
        layer=tuple(parts), outside=tuple(outside), sliding_window=int(window), sliding_layers=sliding,
        attn_logit_softcapping=float(attn_cap), final_logit_softcapping=float(final_cap),
    )  # fmt: skip
