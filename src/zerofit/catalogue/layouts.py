"""The parameter layout of a decoder-only language model, read from its config.json dict alone.

`zerofit plan` needs a model's shapes, its LoRA counts and its FSDP block class. A meta-device build through
transformers answers them exactly for any architecture, but its imports (transformers' modeling stack, peft)
cost seconds, which a user's first plan of a model would pay. For the families zerofit maps
(`zerofit.models.lora_targets`), the layout is a short rule of the config: which linear layers and norms a
decoder layer registers, in order, their sizes and biases; the embeddings, final norm and head outside the
layers; the sliding window and soft-capping the config class derives. Mixtral's, Qwen2-MoE's and
Qwen3-MoE's routed (and shared) experts (`zerofit.catalogue.moe_layouts`) and the Qwen2-VL / Qwen2.5-VL vision towers in front of a Qwen2 language
model (`zerofit.catalogue.vision_layouts`) are read the same way. `model_layout` answers None for anything
the rule cannot decide exactly (another family, a key whose default this rule does not know, a setting that
changes the layout): the caller then builds the model on the meta device, as before.
`tests/unit/planner/test_config_layout.py` holds every answer equal to the meta build's.

Pure (no torch, no transformers): the catalogue's layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from zerofit.catalogue.layout_parts import Layout, Part, Undecided, need
from zerofit.catalogue.moe_layouts import mixtral_mlp, qwen2_moe_mlp, qwen3_moe_mlp
from zerofit.catalogue.vision_layouts import VISION_BLOCKS, vision_parts

__all__ = ["Layout", "Part", "layer_class_by_convention", "layout_model_types", "model_layout"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS2 = ("input_layernorm", "post_attention_layernorm")
_NORMS4 = (*_NORMS2, "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class _Family:
    """How one family's decoder layer is laid out: its attention and MLP linears in registration order, which
    of them carry a bias (`config`: `attention_bias` on the four attention projections; `qkv`: q, k and v
    always; `qkv_bias`: q, k and v as `qkv_bias`, default true), q/k norms, the layer's norms, whether
    `head_dim` must be given (its class default is not hidden / heads) or is never read (hidden / heads), its
    sliding-window and soft-capping rules, and a mixture of experts' MLP rule (its parts and expert fields)."""

    attention: tuple[str, ...] = _ATTENTION
    mlp: tuple[str, ...] = _MLP
    bias: str = "config"
    mlp_bias: bool = False  # the MLP's linears follow `mlp_bias` (Llama), else they have none
    qk_norm: bool = False
    norms: tuple[str, ...] = _NORMS2
    head_dim_required: bool = False
    head_dim_derived: bool = False
    sliding: Callable[[Mapping[str, Any], int], tuple[int, int]] = lambda config, layers: (0, 0)
    softcaps: Callable[[Mapping[str, Any]], tuple[float, float]] = lambda config: (0.0, 0.0)
    moe: Callable[[Mapping[str, Any], int], tuple[list[Part], dict[str, int]]] | None = None


def _every_layer(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """Mistral: the window (given; null: none) on every layer; per-layer types are another class's."""
    if "layer_types" in config:
        raise Undecided("layer_types")
    window = need(config, "sliding_window") or 0
    return (window, layers if window else 0)


def _optional_window(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """Phi-3, Mixtral: an optional window (default none) on every layer; per-layer types are another
    class's."""
    if "layer_types" in config:
        raise Undecided("layer_types")
    window = config.get("sliding_window") or 0
    return (window, layers if window else 0)


def _qwen_window(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
    """Qwen2 / Qwen3: no window unless `use_sliding_window` (then undecided: layers past
    `max_window_layers` only)."""
    if config.get("use_sliding_window"):
        raise Undecided("use_sliding_window")
    return (0, 0)


def _gemma_window(pattern: int | None) -> Callable[[Mapping[str, Any], int], tuple[int, int]]:
    """Gemma 2 (alternating: `pattern` 2) and Gemma 3 (`sliding_window_pattern`, default 6, when `pattern`
    is None): the window and how many layers use it, from `layer_types` when given."""

    def rule(config: Mapping[str, Any], layers: int) -> tuple[int, int]:
        if config.get("use_bidirectional_attention"):
            raise Undecided("use_bidirectional_attention")
        window = need(config, "sliding_window") or 0
        types = config.get("layer_types")
        every = pattern or int(config.get("sliding_window_pattern") or 6)
        if not isinstance(types, list):
            types = ["sliding_attention" if (i + 1) % every else "full" for i in range(layers)]
        return (window, sum(t == "sliding_attention" for t in types) if window else 0)

    return rule


def _gemma2_caps(config: Mapping[str, Any]) -> tuple[float, float]:
    """Gemma 2's soft-caps (attention, final logits): given, or undecided."""
    return (need(config, "attn_logit_softcapping") or 0.0, need(config, "final_logit_softcapping") or 0.0)


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
        attention=("o_proj", "qkv_proj"),
        mlp=("gate_up_proj", "down_proj"),
        bias="none",
        sliding=_optional_window,
    ),
    # Qwen2-MoE: q, k, v biased unless `qkv_bias` is false (its class default: true); its MLP is the experts'.
    "qwen2_moe": _Family(mlp=(), bias="qkv_bias", sliding=_qwen_window, moe=qwen2_moe_mlp),
    "qwen3_moe": _Family(mlp=(), qk_norm=True, sliding=_qwen_window, moe=qwen3_moe_mlp),
    "mixtral": _Family(mlp=(), bias="none", sliding=_optional_window, moe=mixtral_mlp),
}
# A vision-language model's language model (its `text_config`): Qwen2's layer, q/k/v always biased, head_dim
# always hidden / heads.
_VISION_TEXT = _Family(bias="qkv", head_dim_derived=True, sliding=_qwen_window)


def layout_model_types() -> tuple[str, ...]:
    """Every `model_type` whose layout this rule reads from the config."""
    return (*_FAMILIES, *VISION_BLOCKS)


def layer_class_by_convention(architecture: str) -> str:
    """transformers' naming convention for a causal LM's decoder layer: `<Arch>ForCausalLM` ->
    `<Arch>DecoderLayer` (what FSDP shards one by one)."""
    return architecture.removesuffix("ForCausalLM") + "DecoderLayer"


def model_layout(config: Mapping[str, Any]) -> Layout | None:
    """The layout of the model `config` (a config.json dict) describes; None when the rule cannot decide it
    exactly (the caller builds the model on the meta device instead)."""
    model_type = str(config.get("model_type") or "")
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        return None
    try:
        if model_type in VISION_BLOCKS and archs[0] == VISION_BLOCKS[model_type] + "ForConditionalGeneration":
            return _vision_layout(config, model_type)
        family = _FAMILIES.get(model_type)
        if (
            family is None
            or not str(archs[0]).endswith("ForCausalLM")
            or "vision_config" in config
            or "text_config" in config
        ):
            return None
        tied = bool(need(config, "tie_word_embeddings"))
        return _layout(config, family, tied, layer_class_by_convention(str(archs[0])))
    except (Undecided, TypeError, ValueError, AttributeError):
        return None


def _vision_layout(config: Mapping[str, Any], model_type: str) -> Layout:
    """A Qwen2-VL / Qwen2.5-VL model: its language model's layout (`text_config`, named as transformers 5
    nests it) behind the vision tower and projector (`vision_layouts`). The head is tied when the model's
    `tie_word_embeddings` is, or (transformers' forward of older saves) its text config's."""
    text, vision = need(config, "text_config"), need(config, "vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict) or "head_dim" in text:
        raise Undecided("text_config")
    tied = bool(need(config, "tie_word_embeddings")) or bool(text.get("tie_word_embeddings", False))
    stem = VISION_BLOCKS[model_type]
    layout = _layout(text, _VISION_TEXT, tied, f"{stem}DecoderLayer,{stem}VisionBlock")
    outside = tuple(
        Part(f"model.language_model.{p.name.removeprefix('model.')}", p.kind, p.in_features, p.out_features)
        if p.name.startswith("model.") else p
        for p in layout.outside
    )  # fmt: skip
    return replace(layout, outside=(*vision_parts(model_type, vision), *outside),
                   layers_prefix="model.language_model.layers.")  # fmt: skip


def _attention_biases(config: Mapping[str, Any], family: _Family) -> set[str]:
    """The attention projections that carry a bias; undecided when `attention_bias` is set for a family
    whose biases do not follow it."""
    attention_bias = bool(config.get("attention_bias") or False)
    if family.bias == "config":
        return set(_ATTENTION) if attention_bias else set()
    if attention_bias:
        raise Undecided("attention_bias")
    if family.bias == "qkv_bias":
        return set(_ATTENTION[:3]) if config.get("qkv_bias", True) else set()
    return set(_ATTENTION[:3]) if family.bias == "qkv" else set()


def _layer_parts(config: Mapping[str, Any], family: _Family, sizes: dict[str, tuple[int, int]],
                 head_dim: int) -> tuple[list[Part], dict[str, int]]:  # fmt: skip
    """One decoder layer's parts in registration order (attention, q/k norms, MLP or experts, norms) and a
    mixture of experts' `Layout` fields."""
    attn_bias = _attention_biases(config, family)
    mlp_bias = bool(config.get("mlp_bias") or False)
    if mlp_bias and not family.mlp_bias:
        raise Undecided("mlp_bias")
    parts = [Part(f"self_attn.{n}", "linear", *sizes[n], n in attn_bias) for n in family.attention]
    if family.qk_norm:
        parts += [
            Part("self_attn.q_norm", "norm", head_dim, head_dim),
            Part("self_attn.k_norm", "norm", head_dim, head_dim),
        ]
    parts += [Part(f"mlp.{n}", "linear", *sizes[n], mlp_bias) for n in family.mlp]
    experts: dict[str, int] = {}
    if family.moe is not None:
        moe_parts, experts = family.moe(config, sizes["o_proj"][1])
        parts += moe_parts
    hidden = sizes["o_proj"][1]
    return parts + [Part(n, "norm", hidden, hidden) for n in family.norms], experts


def _layout(config: Mapping[str, Any], family: _Family, tied: bool, block_class: str) -> Layout:
    """`model_layout` for a family this rule reads (raises `Undecided`)."""
    hidden, inter = int(need(config, "hidden_size")), int(need(config, "intermediate_size"))
    heads, kv = int(need(config, "num_attention_heads")), int(need(config, "num_key_value_heads"))
    layers, vocab = int(need(config, "num_hidden_layers")), int(need(config, "vocab_size"))
    head_dim = config.get("head_dim") or (need(config, "head_dim") if family.head_dim_required else None)
    head_dim = hidden // heads if family.head_dim_derived else int(head_dim or hidden // heads)
    q, k = heads * head_dim, kv * head_dim
    sizes = {"q_proj": (hidden, q), "k_proj": (hidden, k), "v_proj": (hidden, k), "o_proj": (q, hidden),
             "qkv_proj": (hidden, q + 2 * k), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
             "down_proj": (inter, hidden), "gate_up_proj": (hidden, 2 * inter)}  # fmt: skip
    parts, experts = _layer_parts(config, family, sizes, head_dim)
    outside = [
        Part("model.embed_tokens", "embedding", vocab, hidden),
        Part("model.norm", "norm", hidden, hidden),
    ]
    if not tied:
        outside.append(Part("lm_head", "linear", hidden, vocab))
    window, sliding = family.sliding(config, layers)
    attn_cap, final_cap = family.softcaps(config)
    return Layout(
        model_type=str(need(config, "model_type")), hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab, tied=tied,
        layer=tuple(parts), outside=tuple(outside), sliding_window=int(window), sliding_layers=sliding,
        attn_logit_softcapping=float(attn_cap), final_logit_softcapping=float(final_cap),
        block_class=block_class, **experts,
    )  # fmt: skip
