"""Image + text conversations -> token ids, an assistant-only loss mask and the images' pixel tensors.

    record (OpenAI content parts, or ShareGPT with an `images` list and `<image>` markers)
    -> messages with `{"type": "image"}` parts, and the images (paths relative to the data file)
    -> the tokenizer's chat template (assistant turns marked as for text chat, `zerofit.data.chat`)
    -> each image's one placeholder token expanded to the image's tokens (the processor's rule, after its
       resizing: `data.max_image_tokens`), labelled IGNORE_INDEX: the loss never counts an image token
    -> `VisionExample`: the `Example` ids and labels, with the image processor's tensors.

An image that is missing or cannot be read makes its record a `data.missing_images` case: `drop` (default)
drops and counts it, and refuses a source where more than half the records are such (a wrong folder, not
data); `error` refuses the first one. Either way the message is one paragraph, before any model loads. An
example whose image tokens do not fit in `data.max_seq_len` is refused (a cut image cannot be trained on). An
image whose header says it has more pixels than the model's bound (`data.max_image_pixels`, else from its
processor: `zerofit.models.vision_pixels`) is refused in one paragraph before it is decoded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import DataError
from zerofit.data.cache import CachedData
from zerofit.data.cache_check import checked
from zerofit.data.chat import (
    _assistant_spans,
    _mask_from_spans,
    _render,
    has_generation_marks,
    require_chat_template,
)
from zerofit.data.image_files import ImageTooLarge, open_header, refuse_large, too_large_message
from zerofit.data.sft import DataStats, Example, TokenizedData, has_labels
from zerofit.data.vision_cache import load_vision_cached, save_vision_cached, vision_cache_key
from zerofit.data.vision_mllama import CROSS_MASK, collate_cross, cross_attention_mask
from zerofit.data.vision_sources import images_digest, open_vision_source
from zerofit.models.mllama import CROSS_INPUTS
from zerofit.models.vision_pixels import PixelBound
from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = [
    "IMAGE_INPUTS",
    "MISSING_IMAGE_RULES",
    "VisionExample",
    "collate_images",
    "load_vision_examples",
    "prompt_inputs",
]

MISSING_IMAGE_RULES = ("drop", "error")  # data.missing_images
# The image processor outputs a vision-language model takes as inputs (`batches.model_inputs`).
IMAGE_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "mm_token_type_ids",
    "pixel_attention_mask",
    "token_type_ids",
    *CROSS_INPUTS,
)
TOKEN_TYPES = "mm_token_type_ids"  # per token: 1 an image's, 0 text (right-padded with 0 by `collate_images`)
TOKEN_TYPE_KEYS = (TOKEN_TYPES, "token_type_ids")  # Qwen-VL's and Gemma 3's names for the per-token types
TILED = "pixel_attention_mask"  # SmolVLM's tiles: (samples, tiles, ...), a micro-batch's tiles as one sample
IMAGE_MARKER = "<image>"  # ShareGPT / LLaMA-Factory: where each of the record's `images` goes
# The fix an image above the pixel bound is refused with in training (`data.image_files.too_large_message`).
LARGE_IMAGE_FIX = "or set data.max_image_pixels={pixels} (or more) if images this large are meant."


@dataclass
class VisionExample(Example):
    """An `Example` with its images' tensors (the image processor's, e.g. `pixel_values` and Qwen's
    `image_grid_thw`); empty for a row without images."""

    images: dict[str, torch.Tensor] = field(default_factory=dict)


class MissingImage(Exception):
    """An image of a record cannot be read (the record is a `data.missing_images` case)."""


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: a text part holds {type(value).__name__}, not a string.")
    return value


def _image_ref(part: dict[str, Any], where: str, listed: list[Any], null: bool) -> Any:
    """The image a content part names: `image` (a path or an already-loaded image), or `image_url.url`;
    a bare `{"type": "image"}` (TRL's layout) takes the next of the record's `listed` images."""
    ref = part.get("image", part.get("path"))
    if ref is None and isinstance(part.get("image_url"), dict):
        ref = part["image_url"].get("url")
    if ref is None and (listed or null):
        return _next_listed(listed, null, where)
    if ref is None:
        raise DataError(
            f"{where}: an image part has keys {sorted(part)}; name the image with 'image' (a path relative "
            "to the data file) or 'image_url': {'url': ...}, or list it in the record's 'images'."
        )
    return ref


def _next_listed(listed: list[Any], null: bool, where: str) -> Any:
    """The next of the record's `images` for a marker or a bare image part; None (a missing image) when the
    record's image column is null (`null`)."""
    if listed:
        return listed.pop(0)
    if null:
        return None
    raise DataError(f"{where}: more '<image>' markers or image parts than entries in the record's 'images'.")


def _parts(
    content: Any, where: str, images: list[Any], listed: list[Any], null: bool = False
) -> list[dict[str, Any]]:
    """Message content as template parts; image references go to `images` in order. In a string, each
    `<image>` marker takes the next of the record's `listed` images."""
    if isinstance(content, str):
        pieces = content.split(IMAGE_MARKER)
        out: list[dict[str, Any]] = []
        for i, piece in enumerate(pieces):
            if i:
                images.append(_next_listed(listed, null, where))
                out.append({"type": "image"})
            if piece:
                out.append({"type": "text", "text": piece})
        return out
    if not isinstance(content, list):
        raise DataError(
            f"{where}: message content is {type(content).__name__}, not a string or a list of parts."
        )
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append({"type": "text", "text": _text(part.get("text"), where)})
        elif kind in ("image", "image_url"):
            images.append(_image_ref(part, where, listed, null))
            out.append({"type": "image"})
        else:
            raise DataError(f"{where}: a content part {part!r:.60} is neither text nor an image.")
    return out


def vision_messages(record: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with template parts, the image references in order) of one record."""
    raw = record.get("messages", record.get("conversations"))
    if not isinstance(raw, list):
        raise DataError(
            f"{where}: no 'messages' (or 'conversations') list; a vision-language model trains on chat "
            "messages whose content holds images (an image folder: a 'messages' column in its metadata.jsonl)."
        )
    listed, null = _listed(record)
    images: list[Any] = []
    messages = []
    for message in raw:
        if not isinstance(message, dict):
            raise DataError(f"{where}: a message is a {type(message).__name__}, not an object.")
        role = message.get("role", {"human": "user", "gpt": "assistant"}.get(message.get("from", "")))
        content = message.get("content", message.get("value"))
        parts = _parts(content, where, images, listed, null)
        if role == "assistant" and any(p["type"] == "image" for p in parts):
            raise DataError(f"{where}: an assistant message holds an image; only prompts can.")
        messages.append({"role": role, "content": parts})
    if listed:  # images with no marker: before the first user message's text, as LLaVA data does
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise DataError(f"{where}: the record lists images but has no user message to show them in.")
        first["content"] = [{"type": "image"} for _ in listed] + first["content"]
        images[:0] = listed
    return messages, images


def _listed(record: dict[str, Any]) -> tuple[list[Any], bool]:
    """(the record's `images`, or its one `image` as LLaVA data and an image folder's `file_name` give it;
    whether that column is null: an image the text refers to is then missing, a text-only row stays one)."""
    column = "images" if "images" in record or "image" not in record else "image"
    value = record.get(column)
    if column == "image" and value is not None:
        return [value], False
    return list(value or []), value is None and column in record


def open_image(ref: Any, base: Path, bound: PixelBound | None = None) -> Any:
    """The image `ref` names as RGB (a path relative to `base`, an absolute path, a PIL image, or a
    `datasets` Image dict with bytes); MissingImage when it cannot be read, ImageTooLarge when its header
    says it has more pixels than `bound` (checked before it is decoded: `data.image_files`)."""
    from PIL import Image

    if ref is None or (isinstance(ref, dict) and ref.get("bytes") is None and ref.get("path") is None):
        raise MissingImage("a null image (an empty value in the image column)")
    try:
        image = open_header(ref, base)
        if bound is not None:
            refuse_large(image, ref, bound)
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MissingImage(
            f"{ref if not isinstance(ref, dict) else ref.get('path')!s:.120} ({exc})"
        ) from None


def _ids_and_mask(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> tuple[list[int], list[bool]]:
    """The rendered conversation's token ids and assistant mask (`zerofit.data.chat`'s two ways)."""
    template = require_chat_template(tokenizer, where)
    if has_generation_marks(template):
        out = _render(
            tokenizer, messages, where, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    text, spans = _assistant_spans(tokenizer, messages, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)


def expand_spans(
    ids: list[int], mask: list[bool], placeholder: int, spans: list[list[int]], where: str
) -> tuple[list[int], list[int], int]:
    """(input ids, labels, the end of the last image's span): each `placeholder` the chat template rendered
    replaced by its image's span of tokens (`VisionProcessor.image_spans`, in order), none of them labelled;
    labels only on assistant tokens."""
    found = sum(1 for t in ids if t == placeholder)
    if found != len(spans):
        raise DataError(
            f"{where}: the chat template rendered {found} image placeholders for {len(spans)} images; the "
            "template must render each image part once (check data.chat_template)."
        )
    out_ids: list[int] = []
    labels: list[int] = []
    pending = iter(spans)
    end = 0
    for token, learn in zip(ids, mask, strict=True):
        if token == placeholder:
            span = next(pending)
            out_ids += span
            labels += [IGNORE_INDEX] * len(span)
            end = len(out_ids)
        else:
            out_ids.append(token)
            labels.append(token if learn else IGNORE_INDEX)
    return out_ids, labels, end


def tokenize_vision(
    processor: Any, messages: list[dict[str, Any]], images: list[Any], max_seq_len: int, where: str
) -> tuple[VisionExample, bool]:
    """One conversation with its opened `images` as a `VisionExample` and whether it was cut to
    `max_seq_len` (only text after the last image token may be cut)."""
    ids, mask = _ids_and_mask(processor.tokenizer, messages, where)
    pixels = processor.preprocess(images) if images else {}
    spans = processor.image_spans(pixels) if images else []
    counts = processor.tokens_per_image(pixels) if images else []
    ids, labels, end = expand_spans(ids, mask, processor.placeholder_id, spans, where)
    pixels = {key: value for key, value in pixels.items() if key in IMAGE_INPUTS}
    truncated = len(ids) > max_seq_len
    if truncated and end > max_seq_len:
        raise DataError(
            f"{where}: its {len(ids)} tokens ({sum(counts)} of them image tokens) exceed data.max_seq_len = "
            f"{max_seq_len} and the cut would fall inside an image, which cannot be trained on in part; raise "
            "data.max_seq_len, or lower data.max_image_tokens so each image becomes fewer tokens."
        )
    ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    # Which tokens are an image's (M-RoPE's grid, Gemma 3's mask). Gemma 3's processor returns its types for
    # a text-only row too, and its model builds its masks another way without them (there, with no sliding
    # window): every row carries them, so a row's loss does not depend on the rows it is batched with.
    if processor.token_types and (images or processor.family.token_type_key):
        pixels[processor.token_type_key] = torch.tensor([int(t == processor.image_token_id) for t in ids])
    if images and processor.family.kind == "cross":  # Mllama: which text tokens see the image's tiles
        pixels[CROSS_MASK] = cross_attention_mask(ids, processor.image_token_id, pixels, where)
    return VisionExample(ids, labels, pixels), truncated


def _empty(messages: list[dict[str, Any]]) -> bool:
    """Whether an assistant turn has no text."""
    return any(
        m["role"] == "assistant" and not "".join(p.get("text", "") for p in m["content"]).strip()
        for m in messages
    )


class _VisionLoad:
    """Turns a source's records into `VisionExample`s, counting what happens (one instance per load)."""

    def __init__(self, processor: Any, max_seq_len: int, base: Path, rules: dict[str, str]) -> None:
        self.processor, self.max_seq_len, self.base, self.rules = processor, max_seq_len, base, rules
        self.examples: list[Example] = []
        self.records: list[int] = []
        self.n_records = self.n_truncated = self.n_dropped = self.n_empty = self.n_missing = 0
        self.first_missing = ""

    def add(self, index: int, where: str, record: dict[str, Any]) -> None:
        self.n_records += 1
        messages, refs = vision_messages(record, where)
        if _empty(messages):
            self.n_empty += 1
            if self.rules["empty_responses"] == "error":
                raise DataError(f"{where}: an assistant message is empty (data.empty_responses = 'error').")
            if self.rules["empty_responses"] == "drop":
                self.n_dropped += 1
                return
        try:
            images = [open_image(ref, self.base, self.processor.pixel_bound) for ref in refs]
        except MissingImage as exc:
            self._missing(where, str(exc))
            return
        except ImageTooLarge as exc:
            raise DataError(too_large_message(where, exc, LARGE_IMAGE_FIX)) from None
        example, cut = tokenize_vision(self.processor, messages, images, self.max_seq_len, where)
        self.n_truncated += int(cut)
        if not has_labels(example.labels):
            self.n_dropped += 1
            return
        self.examples.append(example)
        self.records.append(index)

    def _missing(self, where: str, what: str) -> None:
        self.n_missing += 1
        self.n_dropped += 1
        self.first_missing = self.first_missing or f"{where}: {what}"
        if self.rules["missing_images"] == "error":
            raise DataError(
                f"{where}: image {what} cannot be read (data.missing_images = 'error'); fix the path (relative "
                "to the data file's folder), or set data.missing_images=drop to skip such records."
            )

    def result(self, describe: str) -> TokenizedData[Example]:
        if self.n_missing * 2 > self.n_records:
            raise DataError(
                f"{describe}: {self.n_missing} of {self.n_records} records name an image that cannot be read "
                f"(the first: {self.first_missing}); more than half means a wrong image folder, not bad data. "
                "Image paths are relative to the data file's folder; fix them or the files."
            )
        stats = DataStats(
            n_lines=self.n_records,
            n_examples=len(self.examples),
            n_truncated=self.n_truncated,
            n_dropped=self.n_dropped,
            format="messages",
            source=describe,
            n_empty=self.n_empty,
            empty_responses=self.rules["empty_responses"],
            n_missing_images=self.n_missing,
        )
        return TokenizedData(self.examples, stats, self.records)


def load_vision_examples(
    path: str | Path,
    processor: Any,
    max_seq_len: int,
    *,
    split: str = "train",
    subset: str | None = None,
    key: str = "data.path",
    empty_responses: str = "drop",
    missing_images: str = "drop",
    cache: bool = False,
) -> TokenizedData[Example]:
    """Read the conversations `path` names (`zerofit.data.vision_sources`: a data file, a `datasets` source,
    an image folder) and make `VisionExample`s with `processor` (`zerofit.models.vision.VisionProcessor`);
    image paths are relative to the data file's folder. `cache`: reuse / store the result in the
    tokenization cache, keyed on the images' bytes too (`zerofit.data.vision_cache`)."""
    if missing_images not in MISSING_IMAGE_RULES:
        raise ValueError(f"missing_images must be one of {MISSING_IMAGE_RULES}, not {missing_images!r}")
    source, base = open_vision_source(path, split=split, subset=subset, key=key)
    rules = {"empty_responses": empty_responses, "missing_images": missing_images}
    fingerprint = source.fingerprint() if cache else None
    entry = None
    if fingerprint is not None:
        digest = images_digest(source, base, lambda record, where: vision_messages(record, where)[1])
        entry = vision_cache_key(
            fingerprint,
            digest,
            processor,
            max_seq_len=max_seq_len,
            max_pixels=processor.pixel_bound.pixels,
            **rules,
        )
        hit = load_vision_cached(entry, processor, processor.token_type_key or TOKEN_TYPES)
        cached = _from_cache(*hit) if hit is not None else None

        def again(picked: list[int]) -> tuple[list[Example], list[int]]:
            state = _VisionLoad(processor, max_seq_len, base, rules)
            for index, where, record in source.records_at(picked):
                state.add(index, where, record)
            return state.examples, state.records

        if cached is not None and checked(entry, cached.examples, cached.records, again, source.name):
            return cached
    state = _VisionLoad(processor, max_seq_len, base, rules)
    for index, (where, record) in enumerate(source):
        state.add(index, where, record)
    data = state.result(source.describe())
    if entry is not None and data.examples:
        save_vision_cached(
            entry, data.examples, data.records, {"stats": asdict(data.stats)}, processor.tokenizer
        )
    return data


def _from_cache(hit: CachedData, images: list[dict[str, torch.Tensor]]) -> TokenizedData[Example]:
    """The examples of a tokenization cache entry (`vision_cache.load_vision_cached`)."""
    examples: list[Example] = [
        VisionExample(ids, labels, pixels)
        for ids, labels, pixels in zip(hit.ids, hit.labels, images, strict=True)
    ]
    return TokenizedData(examples, DataStats(**{**hit.meta["stats"], "from_cache": True}), hit.records)


def collate_images(examples: list[Example], width: int) -> dict[str, torch.Tensor]:
    """The images' tensors of a micro-batch padded to `width` tokens: the image processor's rows concatenated
    in example order (Qwen-VL's output is per patch and per image, so a batch is the concatenation), the
    per-token types one row per example (0 for text-only rows and padding); {} without images (and types)."""
    keys: dict[str, list[torch.Tensor]] = {}
    for example in examples:
        for name, tensor in getattr(example, "images", {}).items():
            if name not in TOKEN_TYPE_KEYS:
                keys.setdefault(name, []).append(tensor)
    if CROSS_MASK in keys:  # Mllama: images and masks padded per row (`data.vision_mllama`)
        return collate_cross(examples, width)
    joined = {name: join_images(name, tensors) for name, tensors in keys.items()}
    key = next((k for k in TOKEN_TYPE_KEYS for e in examples if k in getattr(e, "images", {})), None)
    if key is None:
        return joined
    types = torch.zeros(len(examples), width, dtype=torch.long)
    for row, example in enumerate(examples):
        tensor = getattr(example, "images", {}).get(key)
        if tensor is not None:
            types[row, : len(tensor)] = tensor
    return {**joined, key: types}


def join_images(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """One image input of a micro-batch: the examples' rows concatenated in example order; SmolVLM's tiles
    ((1, tiles, ...) per example: 5-D pixels, the pixel mask) as one sample of all the tiles, which its
    model splits back over the image tokens in order."""
    if name == TILED or tensors[0].dim() == 5:
        return torch.cat(tensors, dim=1)
    return torch.cat(tensors)


def open_record_images(refs: list[Any], base: Path, bound: PixelBound | None, where: str) -> list[Any]:
    """A record's images opened (`open_image`), or one paragraph naming the record and the image: image
    prompts and image pairs refuse a record whose image cannot be read (supervised data counts and drops it,
    as `data.missing_images` says)."""
    try:
        return [open_image(ref, base, bound) for ref in refs]
    except MissingImage as exc:
        raise DataError(
            f"{where}: image {exc} cannot be read; fix the path (relative to the data file's folder) or "
            "remove the record."
        ) from None
    except ImageTooLarge as exc:
        raise DataError(too_large_message(where, exc, LARGE_IMAGE_FIX)) from None


def vision_prompt(processor: Any, prompt: str, image: Path) -> dict[str, torch.Tensor]:
    """One user turn of `image` then `prompt`, with the generation prompt, as the model's inputs (a batch of
    one): the image's placeholder expanded as in training (`tokenize_vision`); `zerofit generate --image`."""
    where = f"--image {image}"
    try:
        opened = open_image(image, Path.cwd(), processor.pixel_bound)
    except MissingImage as exc:
        raise DataError(
            f"{where}: the image cannot be read ({exc}); pass the path of a PNG or JPEG file."
        ) from None
    except ImageTooLarge as exc:
        raise DataError(too_large_message("zerofit generate --image", exc, "then pass it again.")) from None
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    ids, pixels = prompt_inputs(processor, messages, [opened], where)
    input_ids = torch.tensor([ids])
    if processor.token_types:  # a batch of one: [1, tokens]
        pixels[processor.token_type_key] = pixels[processor.token_type_key].unsqueeze(0)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        **pixels,
    }


def prompt_inputs(
    processor: Any, messages: list[dict[str, Any]], images: list[Any], where: str
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A prompt's token ids (the chat template's generation prompt after `messages`, each image's
    placeholder expanded as in training: `tokenize_vision`) and its image inputs, the per-token types one
    entry per token; `zerofit generate --image` and an online-RL run's image prompts."""
    out = _render(
        processor.tokenizer, messages, where, tokenize=True, return_dict=True, add_generation_prompt=True
    )
    ids = list(out["input_ids"])
    pixels = processor.preprocess(images) if images else {}
    spans = processor.image_spans(pixels) if images else []
    ids, _, _ = expand_spans(ids, [False] * len(ids), processor.placeholder_id, spans, where)
    pixels = {key: value for key, value in pixels.items() if key in IMAGE_INPUTS}
    if processor.token_types:
        pixels[processor.token_type_key] = torch.tensor([int(t == processor.image_token_id) for t in ids])
    if images and processor.family.kind == "cross":
        pixels[CROSS_MASK] = cross_attention_mask(ids, processor.image_token_id, pixels, where)
    return ids, pixels
