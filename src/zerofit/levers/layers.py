"""The one rule for where a model's decoder layers are: the run checkpoints, tiles and compiles the layers
that `decoder_layers` finds, and the planner traces the same ones (`zerofit.planner.shapes`,
`zerofit.planner.trace`), so the plan and the run cannot disagree about them. FSDP2 wraps the classes
`no_split_classes` names. Pure: it walks modules and imports only transformers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["decoder_layers", "decoder_layers_prefix", "no_split_classes"]


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
