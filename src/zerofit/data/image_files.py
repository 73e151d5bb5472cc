"""Opening an image from its header, and refusing one above the model's pixel bound before it is decoded.

PIL's `Image.open` reads only the header (format, size, mode); the pixels are decoded by `.load()` /
`.convert()`. Every image zerofit reads is opened this way first: `zerofit plan` takes sizes from headers alone
(`data.image_rows`), and training (`data.vision`) and `zerofit generate --image` check the size against the
processor's bound (`models.vision_pixels`: `data.max_image_pixels`) before decoding, since an image is decoded
whole before its processor shrinks it (a 13000 x 13000 PNG of one colour, 518 KB on disk, took 2.1 GiB).

Pillow's own decompression-bomb limit is lifted while a header is read: the model's bound decides. Pillow's
knows nothing of the model (it warns from 89 M pixels and refuses from 179 M), and an image it refuses would be
a missing image (dropped and counted), where one above the bound is refused in one paragraph.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from zerofit.core.precision import GIB
from zerofit.models.vision_pixels import PixelBound

__all__ = ["ImageTooLarge", "image_name", "open_header", "refuse_large", "too_large_message"]

DECODED_BYTES_PER_PIXEL = 4  # PIL holds an RGB image as 4 bytes a pixel
MIB = 1 << 20


class ImageTooLarge(Exception):
    """An image's header says it has more pixels than the bound (it was not decoded)."""

    def __init__(self, name: str, size: tuple[int, int], bound: PixelBound) -> None:
        super().__init__(name)
        self.name, self.size, self.bound = name, size, bound


def image_name(ref: Any) -> str:
    """How a message names the image `ref` refers to: its path as the data wrote it."""
    if isinstance(ref, dict):
        return str(ref.get("path") or "an image embedded in the data")
    return str(getattr(ref, "filename", "") or ref)


def open_header(ref: Any, base: Path) -> Any:
    """The image `ref` names, opened but not decoded (a path relative to `base`, an absolute path, a
    `datasets` Image dict with bytes, or an already-opened PIL image); OSError / ValueError as PIL raises
    them when it cannot be read."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref
    pillow_limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None  # the model's bound decides (see the module docstring)
    try:
        if isinstance(ref, dict) and ref.get("bytes") is not None:
            return Image.open(io.BytesIO(ref["bytes"]))
        path = Path(str(ref.get("path") if isinstance(ref, dict) else ref)).expanduser()
        return Image.open(path if path.is_absolute() else base / path)
    finally:
        Image.MAX_IMAGE_PIXELS = pillow_limit


def refuse_large(image: Any, ref: Any, bound: PixelBound) -> None:
    """Raise ImageTooLarge when the opened (not decoded) `image` has more pixels than `bound`."""
    width, height = image.size
    if width * height > bound.pixels:
        raise ImageTooLarge(image_name(ref), (width, height), bound)


def too_large_message(where: str, exc: ImageTooLarge, fix: str) -> str:
    """The one-paragraph refusal of an image above the bound: the image, its size, the bound and where it
    comes from, what decoding it would cost, and `fix` (`{pixels}` in it: the image's pixels)."""
    width, height = exc.size
    pixels = width * height
    side = int(exc.bound.pixels**0.5)
    decoded = pixels * DECODED_BYTES_PER_PIXEL
    cost = f"{decoded / GIB:.1f} GiB" if decoded >= GIB else f"{decoded / MIB:.0f} MiB"
    return (
        f"{where}: image {exc.name} is {width} x {height} = {pixels:,} pixels, above the bound of "
        f"{exc.bound.pixels:,} pixels ({exc.bound.source}); it is refused from its header, before decoding, "
        f"which would take at least {cost} of memory for an image the model's processor shrinks anyway. Shrink "
        f"the image (to {side} x {side} pixels or fewer), {fix.format(pixels=pixels)}"
    )
