"""What a rollout on a vision-language model adds: each prompt's images, in the sampler and in the micro-batch.

An image prompt (`zerofit.data.vision_prompts.VisionPrompt`) carries its processor outputs: pixel rows, the
patch grid and the per-token types (1 on image tokens; Qwen2-VL's M-RoPE reads them). Its rows are
LEFT-padded in a rollout (`zerofit.loop.rollout`), so the types are padded on the left with their ids;
the pixel rows of a batch are its rows' images concatenated in row order (a group's G rows each hold their
prompt's images: each row is its own forward, whatever it is batched with).

Positions: Qwen2-VL's M-RoPE gives an image's tokens a (time, height, width) grid and the text after it
positions that continue from the grid's end, not from the token count. The sampler's prefill takes the
model's own rule (`get_rope_index`, over the real tokens of each left-padded row) and keeps each row's offset
(its last position + 1 - its length); each decoded token is then at its text position plus that offset in
all three axes, which is what the training forward's rule gives the same tokens (the model computes the
positions itself there, from the mask and the types, as for a supervised vision batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zerofit.data.vision import TOKEN_TYPE_KEYS, join_images
from zerofit.objectives.grpo.loss import VISION_PREFIX

__all__ = ["batch_images", "images_of", "prefixed", "rope_positions"]


def images_of(prompt: Any) -> dict[str, torch.Tensor] | None:
    """A prompt's image inputs (an image prompt's), or None for a text prompt."""
    images = getattr(prompt, "images", None)
    return images or None


def batch_images(
    rows: Sequence[dict[str, torch.Tensor]], prompt_width: int, width: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The model's image inputs of a batch whose rows are these prompts' left-padded to `prompt_width`, then
    `width - prompt_width` completion positions (0 for the prefill): pixel rows and grids concatenated in row
    order, the per-token types [rows, width] (the prompt's right-aligned in its `prompt_width`, 0 after)."""
    names = [k for k in rows[0] if k not in TOKEN_TYPE_KEYS]
    out = {k: join_images(k, [r[k] for r in rows]).to(device) for k in names}
    key = next((k for k in TOKEN_TYPE_KEYS if k in rows[0]), None)
    if key is not None:
        types = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r[key])
            types[i, prompt_width - n : prompt_width] = r[key]
        out[key] = types.to(device)
    return out


def prefixed(images: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch's image inputs under the loss's `VISION_PREFIX` (`grpo_inputs` passes them on)."""
    return {VISION_PREFIX + k: v.cpu() for k, v in images.items()}


def _rope_module(model: torch.nn.Module) -> Any:
    """The submodule that owns the model's M-RoPE rule (`get_rope_index`), or None (1-D positions)."""
    return next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)


def rope_positions(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, images: dict[str, torch.Tensor]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the prefill's [3, rows, tokens] positions, each row's offset [rows]) by the model's M-RoPE rule for
    left-padded `ids`, or (None, None) for a model with 1-D positions."""
    owner = _rope_module(model)
    if owner is None:
        return None, None
    key = next(k for k in TOKEN_TYPE_KEYS if k in images)
    positions, deltas = owner.get_rope_index(
        ids, mm_token_type_ids=images[key], image_grid_thw=images.get("image_grid_thw"), attention_mask=mask
    )
    return positions, deltas.view(-1)
