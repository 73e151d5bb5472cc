"""The model class transformers would load, without its weights: its config and a meta-device build.

The planner measures shapes on a meta build, the model pipeline reads parameter names and counts from one
before loading (`zerofit.models.build`), and export rebuilds the base's layout from one
(`zerofit.export.folder`). The decoder layers of such a model are found by the one rule in
`zerofit.levers.layers`. This module imports nothing from the planner, the model pipeline, data, the
strategies or export.
"""

from __future__ import annotations

import copy
from typing import Any

from zerofit.catalogue.models import model_config_dict
from zerofit.core.errors import ConfigError
from zerofit.core.messages import quiet_libraries

__all__ = ["build_meta_model", "hf_config"]


def hf_config(
    name_or_path: str,
    num_layers: int | None = None,
    attn_implementation: str = "sdpa",
    *,
    layer_types: tuple[str, ...] | None = None,
    vision_depth: int | None = None,
) -> Any:
    """A transformers `PretrainedConfig` for a catalogued id or local folder, optionally with fewer layers
    (`layer_types`: the attention type of each of them, for a family that mixes sliding and full layers;
    `vision_depth`: a vision-language model's vision blocks)."""
    from transformers import AutoConfig

    from zerofit.levers.attention import hf_attn_implementation

    quiet_libraries()  # transformers (and peft on a meta build) is imported here: its chatter stays out of plans
    # A deep copy: transformers rewrites nested dicts it is handed (Llama 3.1's `rope_scaling`), and the
    # catalogue's own dict must stay as written (the planner's cache keys hash it).
    data = copy.deepcopy(model_config_dict(name_or_path))
    data.pop("architectures", None)
    if layer_types is not None:
        num_layers = len(layer_types)
        data["layer_types"] = list(layer_types)
    if num_layers is not None:
        data["num_hidden_layers"] = num_layers
        # Per-layer attention types (sliding/full) must match the layer count.
        if isinstance(data.get("layer_types"), list):
            data["layer_types"] = data["layer_types"][:num_layers]
        if isinstance(data.get("text_config"), dict):  # a vision-language model: its language model's layers
            data["text_config"] = _text_layers(data["text_config"], num_layers, layer_types)
    if vision_depth is not None:  # a vision-language model's vision blocks (Qwen-VL's `depth`)
        data["vision_config"] = {
            **data["vision_config"],
            _vision_depth_key(data["vision_config"]): vision_depth,
        }
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    config._attn_implementation = hf_attn_implementation(attn_implementation)
    return config


def _text_layers(
    text_config: dict[str, Any], num_layers: int, layer_types: tuple[str, ...] | None
) -> dict[str, Any]:
    """A vision-language model's language model config with `num_layers` layers, its per-layer attention
    types (Gemma 3's sliding / full `layer_types`) cut or set to match."""
    out = {**text_config, "num_hidden_layers": num_layers}
    if layer_types is not None:
        out["layer_types"] = list(layer_types)
    elif isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:num_layers]
    return out


def _vision_depth_key(vision_config: dict[str, Any]) -> str:
    """The vision config's block count key: Qwen-VL's `depth`, else `num_hidden_layers` (CLIP, SigLIP)."""
    return "depth" if "depth" in vision_config else "num_hidden_layers"


def build_meta_model(
    name_or_path: str,
    num_layers: int | None = None,
    attn_implementation: str = "sdpa",
    dtype: Any = None,
    *,
    layer_types: tuple[str, ...] | None = None,
    vision_depth: int | None = None,
) -> Any:
    """The model class transformers would load, built on the meta device: shapes only, no memory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = hf_config(
        name_or_path, num_layers, attn_implementation, layer_types=layer_types, vision_depth=vision_depth
    )
    # A vision-language model is built whole (vision tower, projector, language model).
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return auto.from_config(config, dtype=dtype or torch.float32)
    except ValueError as exc:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
            raise
        # Gemma 2: soft-capped attention logits have no sdpa kernel in transformers, which refuses it.
        raise ConfigError(
            [
                f"model.attn_implementation = 'sdpa': {name_or_path} ({config.model_type}) has no sdpa "
                "attention in transformers (its attention logits are soft-capped, which only eager "
                "attention computes); set model.attn_implementation=eager (the plan then counts the "
                "S x S probabilities of eager attention)"
            ]
        ) from None
