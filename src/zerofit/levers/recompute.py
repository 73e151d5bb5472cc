"""Selective activation checkpointing: recompute the first n decoder layers in backward, keep the rest.

`train.activation_checkpointing` is `true` (every layer), `false` (none), a number of layers, or `auto`
(the planner picks the number jointly with the micro-batch; `resolve()` replaces `auto` by a number).
Which layers: the *first* n. Every layer's saved tensors are alive at the end of forward whichever layers
are checkpointed, so the peak is the same for any n-subset; but with the first n checkpointed, the layers
above them have already released their saved tensors when backward reaches a checkpointed layer and
recomputes it, so the recomputation never stacks on top of full layers.

A checkpointed layer's loss and gradients are those of the plain layer (non-reentrant
`torch.utils.checkpoint` reruns the same ops); the tests hold n = 1 of 2 against `true` and `false`.
"""

from __future__ import annotations

from typing import Any

from zerofit.core.errors import ConfigError
from zerofit.levers.layers import decoder_layers, no_split_classes

__all__ = [
    "checkpointed_layers",
    "describe_checkpointing",
    "enable_activation_checkpointing",
]


def checkpointed_layers(setting: bool | int | str, num_layers: int) -> int:
    """How many decoder layers a resolved `train.activation_checkpointing` value checkpoints."""
    if setting is True:
        return num_layers
    if setting is False:
        return 0
    if isinstance(setting, int):
        return max(0, min(setting, num_layers))
    raise ValueError(
        f"train.activation_checkpointing = {setting!r} must be resolved to true/false/a number first"
    )


def describe_checkpointing(n: int, num_layers: int) -> str:
    """`all 32 layers`, `none`, or `first 12 of 32 layers` for plans and tables."""
    if n >= num_layers:
        return f"all {num_layers} layers"
    if n <= 0:
        return "none"
    return f"first {n} of {num_layers} layers"


def enable_activation_checkpointing(hf_model: Any, n_layers: int) -> int:
    """Checkpoint (non-reentrant) the first `n_layers` decoder layers of a transformers model; returns how
    many are checkpointed. 0 leaves the model untouched.

    transformers 5 turns it on for every layer (`activation_checkpointing_enable`, which also makes the
    embedding output require grad so frozen embeddings still pass gradients under LoRA); the layers past
    the first n are then switched back off, one flag each.
    """
    if n_layers <= 0:
        return 0
    layers = decoder_layers(hf_model)
    if not layers or not getattr(hf_model, "supports_gradient_checkpointing", False):
        classes = ", ".join(no_split_classes(hf_model)) or "none"
        raise ConfigError(
            [
                f"train.activation_checkpointing = {n_layers} layers: {type(hf_model).__name__} has no decoder "
                f"layer zerofit can checkpoint (no transformers GradientCheckpointingLayer; its own block "
                f"classes, _no_split_modules: {classes}; supports_gradient_checkpointing: "
                f"{getattr(hf_model, 'supports_gradient_checkpointing', False)}). Fix: "
                "train.activation_checkpointing=false, or a model whose transformers class supports it"
            ]
        )
    hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < n_layers
    return min(n_layers, len(layers))
