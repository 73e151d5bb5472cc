"""Llama 3.2 Vision (transformers' Mllama) in training: its images reach the text through cross-attention.

Each image is one `<|image|>` token in the text; the vision tower's states of its tiles are the keys and values
of the language model's cross-attention layers (`cross_attention_layers`), and `cross_attention_mask` says
which text tokens see which image's tiles (from its `<|image|>` token on). A text token that sees no image (a
row without images, the prompt before the image) has an all-off mask row: transformers then lets it attend
evenly over its row's vision states and zeroes the layer's MLP for it. So what such a token becomes depends on
the vision states its row holds, and a row without images must hold the same ones whatever micro-batch it is
in: always one padding image (zero pixels, aspect-ratio id 0, the first tile on in its aspect-ratio mask, as
transformers' processor pads), never none. `padding_images` is that image; `run_idle_images` gives it to a
micro-batch without any image, which transformers would otherwise run with the cross-attention layers skipped
(another curve, and under FSDP2 or ZeRO-3 other collectives than a rank with images).
"""

from __future__ import annotations

from typing import Any

import torch

from zerofit.core.errors import ConfigError

# The Mllama model inputs beyond the text (`zerofit.data.vision.IMAGE_INPUTS` lists them with the others).
CROSS_MASK = (
    "cross_attention_mask"  # per example (1, tokens, images, max tiles); per batch (rows, width, ...)
)
CROSS_INPUTS = ("aspect_ratio_ids", "aspect_ratio_mask", CROSS_MASK)


def padding_images(
    rows: int, images: int, tile: tuple[int, ...], device: Any = None
) -> dict[str, torch.Tensor]:
    """`images` padding images for each of `rows` rows, as transformers' Mllama processor pads: zero pixels
    (rows, images, *`tile`: max tiles, channels, height, width), aspect-ratio id 0, the first tile on in the
    aspect-ratio mask."""
    mask = torch.zeros(rows, images, tile[0], dtype=torch.long, device=device)
    mask[:, :, 0] = 1
    return {
        "pixel_values": torch.zeros(rows, images, *tile, device=device),
        "aspect_ratio_ids": torch.zeros(rows, images, dtype=torch.long, device=device),
        "aspect_ratio_mask": mask,
    }


def tile_shape(vision_config: Any) -> tuple[int, int, int, int]:
    """(max tiles, channels, height, width) of one image's pixel values for Mllama's `vision_config`."""
    side = int(vision_config.image_size)
    return int(vision_config.max_num_tiles), int(vision_config.num_channels), side, side


def run_idle_images(hf: torch.nn.Module) -> None:
    """Give a training or scoring forward without images one padding image per row (`padding_images`), every
    text token's cross-attention mask off: the rows then run as they do beside rows with images, and every
    forward runs the vision tower and the cross-attention layers. Generation (a cache) is left as it is."""
    inner = hf.model

    def before(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        given = ("pixel_values", "cross_attention_states", "cache", "past_key_values")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or any(kwargs.get(key) is not None for key in given):
            return args, kwargs
        rows, width = ids.shape
        tile = tile_shape(module.config.vision_config)
        idle = padding_images(rows, 1, tile, ids.device)
        idle[CROSS_MASK] = torch.zeros(rows, width, 1, tile[0], dtype=torch.long, device=ids.device)
        return args, {**kwargs, **idle}

    inner.register_forward_pre_hook(before, with_kwargs=True)


def checkpointable_vision_layers(hf: torch.nn.Module) -> None:
    """Make Mllama's vision encoder layers transformers checkpointing layers, as its decoder layers and other
    families' vision blocks are, so `train.activation_checkpointing` (`zerofit.levers.recompute`) covers the
    vision tower too. Only the class changes (a subclass of the same name, for `_no_split_modules`): the
    weights, the forward and the output stay the same."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    classes: dict[type, type] = {}
    for module in hf.modules():
        cls = type(module)
        if cls.__name__ != "MllamaVisionEncoderLayer" or isinstance(module, GradientCheckpointingLayer):
            continue
        if cls not in classes:
            classes[cls] = type(
                cls.__name__, (GradientCheckpointingLayer, cls), {"__module__": cls.__module__}
            )
        module.__class__ = classes[cls]


def refuse_image_token_limit(max_image_tokens: int | None, vision_config: dict[str, Any], name: str) -> None:
    """`data.max_image_tokens` has nothing to lower for Mllama: an image is one text token, and the vision
    states the text reads are always the model's `max_num_tiles` tiles (a smaller image's are padding), so
    it is refused rather than ignored."""
    if max_image_tokens is None:
        return
    per_tile = (int(vision_config["image_size"]) // int(vision_config["patch_size"])) ** 2 + 1
    raise ConfigError(
        [
            f"data.max_image_tokens = {max_image_tokens} with {name}, a Llama 3.2 Vision (mllama) model: each "
            f"image is one <|image|> token in the text and always {vision_config['max_num_tiles']} tiles of "
            f"{per_tile} vision states read through cross-attention, so there is nothing to lower; remove "
            "data.max_image_tokens"
        ]
    )
