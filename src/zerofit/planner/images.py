"""How many image tokens a planned micro-batch carries: from the data's images when `zerofit plan` reads them,
else the worst case `data.max_seq_len` and `data.max_image_tokens` allow; and the vision tower's dimensions.

Each image becomes tokens by its family's processor rule (`zerofit.models.vision`): Qwen-VL resizes it (aspect
kept) onto a grid of (patch x merge)-pixel squares between the processor's fewest and most pixels
(transformers' own `smart_resize`), each square one language-model token of merge^2 patches; a fixed-size
family (LLaVA) makes every image (image_size / patch)^2 tokens. The tokens are already part of the sequence
(`data.max_seq_len` includes them: a row whose images do not fit is refused), so the language-model terms
count them; what the images add is the vision tower's and projector's work over their patches
(`activations.vision`).

`zerofit plan` reads the data's image sizes (a higher layer: `zerofit.data.image_rows`) and hands them in
through `observed_images`, so every scenario of the plan (the micro-batch table, the search) counts the same
distribution: the worst micro-batch is the `micro_batch_size` rows with the most image tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from zerofit.catalogue.models import model_config_dict
from zerofit.catalogue.vision_models import VLM_PIXEL_LIMITS
from zerofit.core.errors import ConfigError

# Qwen2-VL's image processor limits when its preprocessor_config.json cannot be read (transformers' defaults:
# 56 x 56 pixels at least, 28 x 28 x 1280 at most).
DEFAULT_PIXEL_LIMITS = (56 * 56, 28 * 28 * 1280)


@dataclass(frozen=True)
class ImageRows:
    """The image tokens of each planned row, most first, and where they come from (said in the plan)."""

    row_tokens: tuple[int, ...]  # per row, sorted descending (rows without images: 0)
    largest_image: int  # tokens of the largest single image
    source: str  # in words: the data read, or the worst case assumed
    every_row: int = 0  # the worst case: every row this many image tokens (`row_tokens` unused)

    def micro_batch(self, rows: int) -> int:
        """Image tokens of the worst micro-batch of `rows` rows (the `rows` rows with the most)."""
        return rows * self.every_row if self.every_row else sum(self.row_tokens[:rows])


@dataclass(frozen=True)
class VisionDims:
    """A vision tower's dimensions, from the model's `vision_config`."""

    depth: int  # vision blocks
    hidden: int
    intermediate: int
    heads: int
    patches_per_token: int  # patches merged into one language-model token (Qwen: merge^2; else 1)
    patch_width: int  # values per patch the tower reads (channels x frames x patch^2)
    merged_width: int  # the projector's input width per token (merge^2 x hidden)


_OBSERVED: contextvars.ContextVar[ImageRows | None] = contextvars.ContextVar("observed_images", default=None)


@contextlib.contextmanager
def observed_images(rows: ImageRows | None) -> Iterator[None]:
    """Plan with the data's image tokens `rows` (None: the worst case) inside this block."""
    token = _OBSERVED.set(rows)
    try:
        yield
    finally:
        _OBSERVED.reset(token)


def vision_dims(model: str) -> VisionDims | None:
    """The vision tower of `model` (None for a language model)."""
    vc = model_config_dict(model).get("vision_config")
    if not isinstance(vc, dict):
        return None
    merge = int(vc.get("spatial_merge_size", 1))
    channels = int(vc.get("in_channels", vc.get("num_channels", 3)))
    frames = int(vc.get("temporal_patch_size", 1))
    hidden = int(vc.get("hidden_size") or vc.get("embed_dim"))
    return VisionDims(
        depth=int(vc.get("depth") or vc.get("num_hidden_layers")) + int(vc.get("num_global_layers", 0)),
        hidden=hidden,
        intermediate=int(vc.get("intermediate_size") or hidden * vc.get("mlp_ratio", 4)),
        heads=int(vc.get("num_heads") or vc.get("num_attention_heads") or vc.get("attention_heads")),
        patches_per_token=merge * merge,
        patch_width=channels * frames * int(vc["patch_size"]) ** 2,
        merged_width=merge * merge * hidden,
    )


def pixel_limits(model: str, max_image_tokens: int | None) -> tuple[int, int]:
    """(fewest, most) pixels of one image after the processor's resizing: the catalogue's or the model
    folder's preprocessor_config.json, the most lowered to `data.max_image_tokens` tokens."""
    limits = VLM_PIXEL_LIMITS.get(model)
    pre = Path(model) / "preprocessor_config.json"
    if limits is None and pre.is_file():
        data = json.loads(pre.read_text())
        size = data.get("size") or {}
        least = data.get("min_pixels") or size.get("shortest_edge") or DEFAULT_PIXEL_LIMITS[0]
        most = data.get("max_pixels") or size.get("longest_edge") or DEFAULT_PIXEL_LIMITS[1]
        limits = (int(least), int(most))
    least, most = limits or DEFAULT_PIXEL_LIMITS
    if max_image_tokens is not None:
        most = min(most, max_image_tokens * _unit(model) ** 2)
    return least, most


def _unit(model: str) -> int:
    """The side in pixels of one language-model token's square (patch x merge)."""
    vc = model_config_dict(model)["vision_config"]
    return int(vc["patch_size"]) * int(vc.get("spatial_merge_size", 1))


def image_tokens(model: str, width: int, height: int, max_image_tokens: int | None) -> int:
    """Tokens one `width` x `height` image becomes for `model`, by its processor's rule."""
    cfg = model_config_dict(model)
    vc = cfg["vision_config"]
    if "spatial_merge_size" not in vc:  # a fixed-size tower: every image resized to image_size
        side = int(vc["image_size"]) // int(vc["patch_size"])
        tiles = int(vc.get("max_num_tiles", 1))  # Llama 3.2 Vision: up to 4 tiles + a class token each
        return tiles * (side * side + (1 if tiles > 1 else 0))
    unit = _unit(model)
    least, most = pixel_limits(model, max_image_tokens)
    h, w = smart_resize(height, width, factor=unit, min_pixels=least, max_pixels=most)
    return (h // unit) * (w // unit)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) Qwen-VL's image processor resizes an image to: both sides multiples of `factor`,
    the area within [min_pixels, max_pixels], the aspect ratio kept as closely as that allows.

    transformers' own rule (`transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.smart_resize`), written
    here so that a plan does not import transformers' image processing stack (~3 CPU-s) for 15 lines of
    arithmetic; tests/unit/planner/test_planner_vision.py holds it equal to transformers' on a grid of sizes and
    limits, so an upgrade that changes the rule fails there.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def rows_from_sizes(
    model: str, sizes: list[list[tuple[int, int]]], max_image_tokens: int | None, source: str
) -> ImageRows:
    """`ImageRows` of data whose rows hold images of these (width, height) sizes."""
    per_image = [[image_tokens(model, w, h, max_image_tokens) for w, h in row] for row in sizes]
    rows = tuple(sorted((sum(r) for r in per_image), reverse=True))
    largest = max((t for r in per_image for t in r), default=0)
    return ImageRows(rows or (0,), largest, source)


def worst_case_rows(model: str, seq_len: int, max_image_tokens: int | None) -> ImageRows:
    """Without the data: every row all image tokens (`data.max_seq_len`), in images as large as allowed."""
    if model_config_dict(model).get("text_config", {}).get("cross_attention_layers"):
        # Llama 3.2 Vision: an image is one token of the sequence; its tiles' states are cross-attended.
        largest = image_tokens(model, 1, 1, None)
        source = f"worst case (no data read): one image of {largest} states (every tile) per row"
        return ImageRows((), largest, source, every_row=largest)
    most = pixel_limits(model, max_image_tokens)[1] // _unit(model) ** 2 if _grid(model) else 0
    largest = min(seq_len, most or image_tokens(model, 1, 1, None))
    limit = f"data.max_image_tokens {max_image_tokens}" if max_image_tokens else "the processor's limit"
    source = (
        f"worst case (no data read): every row {seq_len} image tokens (data.max_seq_len), the largest image "
        f"{largest} tokens ({limit}); give the data (data.path) to plan its own images"
    )
    return ImageRows((), largest, source, every_row=seq_len)


def _grid(model: str) -> bool:
    return "spatial_merge_size" in model_config_dict(model)["vision_config"]


def planned_images(model: str, seq_len: int, max_image_tokens: int | None) -> ImageRows | None:
    """The image tokens a plan counts for `model`: the data's (`observed_images`), else the worst case;
    None for a language model."""
    try:
        if vision_dims(model) is None:
            return None
    except ConfigError:  # a config that cannot be read here: the shapes say so where they need it
        return None
    return _OBSERVED.get() or worst_case_rows(model, seq_len, max_image_tokens)


def observed_source(path: str, rows: int, images: int, missing: int) -> str:
    """The plan's words for image tokens read from the data."""
    skipped = f", {missing} unreadable image(s) not counted" if missing else ""
    return f"from the data ({path}: {rows} rows, {images} images{skipped}); the worst micro-batch planned"
