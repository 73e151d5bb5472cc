"""Llama 3.2 Vision (Mllama) examples: one `<|image|>` token per image, the image's tiles read through
cross-attention (`zerofit.models.mllama`), so beside the ids an example holds its `cross_attention_mask` (per
text token, which of the image's tiles it sees: transformers' own rule, from the image token on), and a
micro-batch pads its rows' images and masks (`collate_cross`).

One image per conversation: a text token that sees no image (the prompt before the image) attends evenly over
its row's vision states, padding images included, so with several images per row what it becomes would depend
on how many images the other rows of its micro-batch have, and the loss curve on the split.
"""

from __future__ import annotations

from typing import Any

import torch

from zerofit.core.errors import DataError
from zerofit.models.mllama import CROSS_MASK, padding_images


def cross_attention_mask(
    ids: list[int], image_token_id: int, pixels: dict[str, torch.Tensor], where: str
) -> torch.Tensor:
    """The example's cross-attention mask (1, len(ids), images, max tiles): transformers' Mllama processor's
    rule (each image seen from its `<|image|>` token on, on its real tiles); one image at most."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    tiles = pixels["aspect_ratio_mask"]  # (1, images, max tiles): 1 on an image's tiles
    if tiles.shape[1] > 1:
        raise DataError(
            f"{where}: {tiles.shape[1]} images in one conversation; zerofit trains Llama 3.2 Vision (mllama) "
            "on one image per conversation (a token before the image attends over every image of its row, "
            "so the curve would depend on the split); keep one image per record, or split the record."
        )
    spans = [get_cross_attention_token_mask(ids, image_token_id)]
    counts = [[int(n) for n in tiles[0].sum(dim=-1)]]
    dense = convert_sparse_cross_attention_mask_to_dense(spans, counts, int(tiles.shape[-1]), len(ids))
    return torch.from_numpy(dense)


def collate_cross(examples: list[Any], width: int) -> dict[str, torch.Tensor]:
    """A micro-batch's Mllama inputs, padded to `width` tokens: every row has as many images as the most of
    any row (a row with fewer, or none, gets transformers' padding image), each row's cross-attention mask in
    its first tokens, off on padding and for a row without images."""
    held = [getattr(e, "images", {}) for e in examples]
    first = next(h for h in held if h)
    tile = tuple(first["pixel_values"].shape[2:])
    count = max(int(h["pixel_values"].shape[1]) for h in held if h)
    out = padding_images(len(examples), count, tile)
    out[CROSS_MASK] = torch.zeros(len(examples), width, count, tile[0], dtype=torch.long)
    for row, images in enumerate(held):
        if not images:
            continue
        n = int(images["pixel_values"].shape[1])
        for key in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
            out[key][row, :n] = images[key][0]
        mask = images[CROSS_MASK][0]
        out[CROSS_MASK][row, : mask.shape[0], :n] = mask
    return out
