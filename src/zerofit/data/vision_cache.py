"""The tokenization cache for image + text data: a second run on the same data and images starts without
opening, resizing and tokenizing them again.

An entry is the text cache's (`zerofit.data.cache`: ids, label mask, offsets, records, meta.json with its
SHA-256 digest) plus `images.safetensors`, the examples' image tensors (never a pickle): per tensor name (the
image processor's `pixel_values`, Qwen's `image_grid_thw`, the per-token types) the examples' tensors
flattened and concatenated, `offsets.<name>` (int64, one more than the examples) where each example's values
start, `shapes.<name>` (int64, one row per example) its shape (tensors differ per example beyond their first
dimension: SmolVLM's tiles, Mllama's cross-attention masks), and `keys.<name>` (uint8, one per example) whether
it has that tensor at all (a text-only row has none). The key (`vision_cache_key`) holds everything that decides the tokens and pixels:
the records' content, the SHA-256 of every image they name (`vision_sources.images_digest`), the tokenizer
with its chat template, the image processor's settings (its pixel limits: `data.max_image_tokens` lowers
them) and the model's image rule, max_seq_len, the data rules and the pixel bound.

Before use an entry is checked (`load_cached`'s digest and array checks, which cover the attached file), and
then its image tensors against what the token ids claim: each example's image tokens are as many as its
images make by the processor's rule, and its token types mark exactly those tokens. One that fails is
removed, read again and written anew, with a one-line note. A sound entry is then checked against its
source as a text entry is (`zerofit.data.cache_check`: a seeded sample of records read, their images
opened and processed, and tokenized again, ids, labels and image tensors compared exactly).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from zerofit.data.cache import (
    cache_key,
    discard_entry,
    entry_dir,
    load_cached,
    save_cached,
    tokenizer_fingerprint,
    vocab_size,
)

__all__ = ["IMAGES_FILE", "VISION_PIPELINE", "load_vision_cached", "save_vision_cached", "vision_cache_key"]

IMAGES_FILE = "images.safetensors"
VISION_PIPELINE = 1  # bump when zerofit turns images into tokens or tensors differently (`data.vision`)
_OFFSETS, _KEYS, _SHAPES = "offsets.", "keys.", "shapes."


def vision_cache_key(source_fingerprint: str, images: str, processor: Any, **parts: Any) -> str:
    """The entry name of a source (its content hash and its images' digest) read with `processor`
    (`zerofit.models.vision.VisionProcessor`) and `parts` (max_seq_len, the data rules)."""
    return cache_key(
        source=source_fingerprint,
        images=images,
        tokenizer=tokenizer_fingerprint(processor.tokenizer),
        image_processor=processor.image_processor.to_dict(),
        family=processor.family.model_type,
        model=processor.model_config,
        vision=VISION_PIPELINE,
        **parts,
    )


def _pack(images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The examples' image tensors as `images.safetensors` holds them (see the module docstring)."""
    names = sorted({name for example in images for name in example})
    out: dict[str, torch.Tensor] = {}
    for name in names:
        parts = [example[name] for example in images if name in example]
        ndim = parts[0].dim()
        sizes = [example[name].numel() if name in example else 0 for example in images]
        shapes = [list(example[name].shape) if name in example else [0] * ndim for example in images]
        out[name] = torch.cat([p.reshape(-1) for p in parts])
        out[_OFFSETS + name] = torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
        out[_KEYS + name] = torch.tensor([name in example for example in images], dtype=torch.uint8)
        out[_SHAPES + name] = torch.tensor(shapes, dtype=torch.int64).reshape(len(images), ndim)
    return out


def save_vision_cached(
    key: str, examples: list[Any], records: list[int], meta: dict[str, Any], tokenizer: Any
) -> None:
    """Store `examples` (`VisionExample`s) under `key`, their image tensors as safetensors."""
    from safetensors.torch import save

    images = [getattr(example, "images", {}) for example in examples]
    blob = save(_pack(images)) if any(images) else save({})
    ids = [example.input_ids for example in examples]
    labels = [example.labels for example in examples]
    save_cached(key, ids, labels, records, meta, vocab_size(tokenizer), {IMAGES_FILE: blob})


def _unpack(tensors: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Each example's image tensors from what `_pack` wrote; ValueError naming what does not add up."""
    names = [name for name in tensors if not name.startswith((_OFFSETS, _KEYS, _SHAPES))]
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for name in names:
        offsets, keys = tensors.get(_OFFSETS + name), tensors.get(_KEYS + name)
        shapes, flat = tensors.get(_SHAPES + name), tensors[name]
        if offsets is None or keys is None or offsets.shape != (n + 1,) or keys.shape != (n,):
            raise ValueError(f"{name} lacks the offsets and keys of {n} examples")
        if shapes is None or shapes.dim() != 2 or shapes.shape[0] != n or flat.dim() != 1:
            raise ValueError(f"{name} is not a flat tensor with the shapes of {n} examples")
        steps = offsets.diff()
        if int(offsets[0]) != 0 or int(offsets[-1]) != flat.numel() or bool((steps < 0).any()):
            raise ValueError(f"offsets.{name} does not run from 0 to the {flat.numel()} values of {name}")
        for index in range(n):
            shape = [int(d) for d in shapes[index]]
            if bool(keys[index]) and int(torch.tensor(shape).prod()) == int(steps[index]):
                out[index][name] = flat[int(offsets[index]) : int(offsets[index + 1])].reshape(shape)
            elif bool(keys[index]) or int(steps[index]):
                raise ValueError(f"example {index}'s {name} does not match its recorded shape {shape}")
    return out


def _claims_problem(
    ids: list[list[int]], images: list[dict[str, torch.Tensor]], processor: Any, token_types: str
) -> str | None:
    """Whether each example's image tensors make as many image tokens as its ids hold, the processor's rule
    (`tokens_per_image`), with the per-token types (the tensor named `token_types`) marking exactly those."""
    image_id = processor.image_token_id
    for index, (tokens, pixels) in enumerate(zip(ids, images, strict=True)):
        wanted = sum(t == image_id for t in tokens)
        pixel_rows = {name: t for name, t in pixels.items() if name != token_types}
        try:
            made = processor.stored_image_tokens(pixel_rows) if pixel_rows else 0
        except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as exc:
            return f"example {index}'s image tensors are not the processor's ({type(exc).__name__}: {exc})"
        if made != wanted:
            return f"example {index}'s images make {made} image tokens where its ids hold {wanted}"
        types = pixels.get(token_types)
        if types is not None and types.tolist() != [int(t == image_id) for t in tokens]:
            return f"example {index}'s token types do not mark its image tokens"
    return None


def _image_problem(
    folder: Any, ids: list[list[int]], processor: Any, token_types: str
) -> tuple[Any, str | None]:
    """(the examples' image tensors, None) for a sound `images.safetensors`, else (None, what is wrong)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        images = _unpack(load_file(folder / IMAGES_FILE), len(ids))
    except (OSError, ValueError, IndexError, SafetensorError) as exc:
        return None, f"{IMAGES_FILE} could not be read ({type(exc).__name__}: {exc})"
    return images, _claims_problem(ids, images, processor, token_types)


def load_vision_cached(
    key: str, processor: Any, token_types: str
) -> tuple[Any, list[dict[str, torch.Tensor]]] | None:
    """(the `CachedData` of `key`, each example's image tensors), or None when there is no sound entry
    (one that fails a check is removed, with a one-line note: the caller reads the data again).
    `token_types`: the name of the per-token types tensor (`data.vision.TOKEN_TYPES`)."""
    hit = load_cached(key, vocab_size(processor.tokenizer))
    if hit is None:
        return None
    folder = entry_dir(key)
    images, problem = _image_problem(folder, hit.ids, processor, token_types)
    if problem is None:
        return hit, images
    print(
        f"zerofit: tokenization cache entry {folder} {problem}: reading the data again, replacing it",
        file=sys.stderr,
        flush=True,
    )
    discard_entry(key)
    return None
