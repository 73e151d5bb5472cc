"""The data's image sizes for `zerofit plan`: each record's images, read from their file headers (no pixels
decoded, no processor), so the planner counts the image tokens this data makes
(`zerofit.planner.images.rows_from_sizes`) instead of the worst case.

Records are read as training reads them (`open_source`, `vision_messages`: OpenAI content parts, ShareGPT
`images` with `<image>` markers, paths relative to the data file). An image that cannot be read, or a record
that is not a conversation, is left out and counted (training applies `data.missing_images` to it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError
from zerofit.data.image_files import open_header
from zerofit.data.records import open_source
from zerofit.data.vision import vision_messages
from zerofit.planner.images import ImageRows, observed_source, rows_from_sizes, vision_dims


def _size(ref: Any, base: Path) -> tuple[int, int] | None:
    """(width, height) of the image `ref` names, from its header; None when it cannot be read."""
    from PIL import Image

    try:
        image = open_header(ref, base)
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    if image is not ref:  # a file or bytes this opened (not the caller's image): its header was enough
        image.close()
    return image.size


def image_sizes(
    path: str, split: str = "train", subset: str | None = None
) -> tuple[list[list[tuple[int, int]]], int]:
    """Each record's images' (width, height), and how many images or records could not be read."""
    local = Path(path).expanduser()
    base = local.parent if local.is_file() else local
    rows: list[list[tuple[int, int]]] = []
    unreadable = 0
    for where, record in open_source(path, split=split, subset=subset, key="data.path"):
        try:
            refs = vision_messages(record, where)[1]
        except DataError:
            unreadable += 1
            continue
        sizes = [_size(ref, base) for ref in refs]
        unreadable += sum(s is None for s in sizes)
        rows.append([s for s in sizes if s is not None])
    return rows, unreadable


def plan_images(cfg: Any) -> ImageRows | None:
    """The image tokens of `cfg`'s data for its vision-language model (None: a language model, or no data
    the plan can read, when the planner assumes the worst case and says so)."""
    model, d = cfg.model.name_or_path, cfg.data
    try:
        if vision_dims(model) is None or not d.path or not Path(d.path).expanduser().exists():
            return None  # a language model, or data that is not local (the plan downloads nothing)
        rows, unreadable = image_sizes(d.path, d.split, d.subset)
    except (OSError, ValueError, DataError):  # the data cannot be read here: the worst case is planned
        return None
    images = sum(len(r) for r in rows)
    source = observed_source(d.path, len(rows), images, unreadable)
    return rows_from_sizes(model, rows, d.max_image_tokens, source)
