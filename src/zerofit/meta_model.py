"""The model class transformers would load, without its weights: its config, a meta-device build, and the
one rule for where a model's decoder layers are.

The planner measures shapes on a meta build, the model pipeline reads parameter names and counts from one
before loading (`zerofit.model`), export rebuilds the base's layout from one (`zerofit.export.folder`), and
the run checkpoints, tiles and compiles the decoder layers that `decoder_layers` finds: the trace and the
run walk the same layers because there is one rule. This module sits below all of them: it imports nothing
from the planner, the model pipeline, data, the strategies or export.
"""

from __future__ import annotations

from typing import Any

from zerofit.catalogue import model_config_dict
from zerofit.errors import ConfigError

__all__ = ["build_meta_model", "decoder_layers", "decoder_layers_prefix", "hf_config", "no_split_classes"]


def hf_config(
    name_or_path: str,
    num_layers: int | None = None,
    attn_implementation: str = "sdpa",
    *,
    layer_types: tuple[str, ...] | None = None,
) -> Any:
    """A transformers `PretrainedConfig` for a catalogued id or local folder, optionally with fewer layers
    (`layer_types`: the attention type of each of them, for a family that mixes sliding and full layers)."""
    from transformers import AutoConfig

    from zerofit.attention import hf_attn_implementation

    data = model_config_dict(name_or_path)
    data.pop("architectures", None)
    if layer_types is not None:
        num_layers = len(layer_types)
        data["layer_types"] = list(layer_types)
    if num_layers is not None:
        data["num_hidden_layers"] = num_layers
        # Per-layer attention types (sliding/full) must match the layer count.
        if isinstance(data.get("layer_types"), list):
            data["layer_types"] = data["layer_types"][:num_layers]
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    config._attn_implementation = hf_attn_implementation(attn_implementation)
    return config


def build_meta_model(
    name_or_path: str,
    num_layers: int | None = None,
    attn_implementation: str = "sdpa",
    dtype: Any = None,
    *,
    layer_types: tuple[str, ...] | None = None,
) -> Any:
    """The model class transformers would load, built on the meta device: shapes only, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(name_or_path, num_layers, attn_implementation, layer_types=layer_types)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
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


def no_split_classes(model: Any) -> list[str]:
    """The block classes the model itself says must stay whole (`_no_split_modules` of its transformers
    class, or of the transformers model under a peft / FSDP wrapper), in the model's order."""
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or []:
            if name not in names:
                names.append(name)
    return names


def decoder_layers(hf_model: Any) -> list[Any]:
    """The model's repeated decoder blocks, in order: transformers' `GradientCheckpointingLayer`s, or (a
    model whose layers are not, e.g. custom code) the modules of the classes its `_no_split_modules` names.
    Empty when the model has neither. Works through peft and FSDP wrappers (it walks every module)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in hf_model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    classes = set(no_split_classes(hf_model))
    return [m for m in hf_model.modules() if type(m).__name__ in classes]


def decoder_layers_prefix(hf_model: Any) -> str:
    """The dotted name the decoder layers' parameters start with (`model.layers.` for Llama, under peft
    `base_model.model.model.layers.`): parameters outside it are the embeddings, final norm and head."""
    layers = decoder_layers(hf_model)
    if layers:
        for name, module in hf_model.named_modules():
            if module is layers[0]:
                return name.rpartition(".")[0] + "."
    raise TypeError(f"cannot find decoder layers in {type(hf_model).__name__}")
