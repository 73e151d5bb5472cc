"""The largest image a vision-language model's processor uses, and the bound on the images zerofit decodes for
it (`data.max_image_pixels`).

An image is decoded whole before its processor shrinks it: a 13000 x 13000 PNG of one colour, 518 KB on disk,
took 2.1 GiB of memory to decode for a model that sees at most 112 x 112 pixels of it. So an image whose
header (read without decoding) says it is larger than the bound is refused before it is decoded. The bound
follows from the processor's own config (before `data.max_image_tokens` lowers it): `MARGIN` times its largest
useful image, at least `FLOOR` pixels (an image that small decodes in tens of MB, whatever the model):

    grid   (Qwen2-VL / Qwen2.5-VL)  its max_pixels (`size.longest_edge`, in pixels)
    tiles  (SmolVLM / Idefics3)     its longest edge, squared
    fixed  (LLaVA)                  its crop (or resize) size, height x width
    pooled (Gemma 3)                its resize size, height x width
    cross  (Llama 3.2 Vision)       its tile size, height x width, times its most tiles per image
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MARGIN = 4  # the bound over the processor's largest useful image, in pixels (area)
FLOOR = 2048 * 2048  # the least bound: an image this small costs little to decode (~16 MB at 4 bytes a pixel)


def _area(size: Any) -> int | None:
    """height x width of a processor's size (a dict or transformers' SizeDict), None when it has none."""
    height, width = _get(size, "height"), _get(size, "width")
    return int(height) * int(width) if height and width else None


def _get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def processor_largest_pixels(image_processor: Any, kind: str) -> int | None:
    """The most pixels of one image the processor makes use of (the family's rule above); None when its
    config names no size (the bound is then `FLOOR`)."""
    size = getattr(image_processor, "size", None) or {}
    if kind == "grid":
        most = getattr(image_processor, "max_pixels", None) or _get(size, "longest_edge")
        return int(most) if most else None
    if kind == "tiles":
        edge = _get(size, "longest_edge")
        return int(edge) ** 2 if edge else None
    if kind == "fixed" and getattr(image_processor, "do_center_crop", False):
        crop = _area(getattr(image_processor, "crop_size", None) or {})
        if crop:
            return crop
    area = _area(size)
    if area is None and _get(size, "shortest_edge"):  # a CLIP-style resize of the shortest edge
        area = int(_get(size, "shortest_edge")) ** 2
    if area is not None and kind == "cross":
        area *= int(getattr(image_processor, "max_image_tiles", 1) or 1)
    return area


@dataclass(frozen=True)
class PixelBound:
    """The most pixels one image may have, and where that number comes from (in words, for the refusal)."""

    pixels: int
    source: str


def pixel_bound(image_processor: Any, kind: str, configured: int | None) -> PixelBound:
    """The bound on one image's pixels for a processor of family `kind`: `data.max_image_pixels` when set
    (`configured`), else `MARGIN` x the processor's largest useful image, at least `FLOOR`."""
    if configured is not None:
        return PixelBound(int(configured), "data.max_image_pixels")
    largest = processor_largest_pixels(image_processor, kind)
    used = f"{largest:,} pixels" if largest else "not stated in its config"
    side = int(FLOOR**0.5)
    return PixelBound(
        max(MARGIN * largest, FLOOR) if largest else FLOOR,
        f"{MARGIN} x the largest image the model's processor uses, {used}, and at least {side} x {side}",
    )
