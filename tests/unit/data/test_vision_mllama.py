"""Llama 3.2 Vision data (`zerofit.data.vision_mllama`): the bundled image data through tiny-mllama's
own image processor (tiles, aspect-ratio ids and masks) and chat template: one `<|image|>` token per image,
never labelled; a cross-attention mask per example by transformers' rule; a micro-batch padding the images
and masks of its rows (a row without images all off); two images in one conversation refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config_helpers import config
from zerofit.core.errors import ConfigError, DataError
from zerofit.data import IGNORE_INDEX, collate
from zerofit.data.vision import load_vision_examples
from zerofit.models.build import load_tokenizer
from zerofit.models.tiny_vision import ensure_tiny_vlm
from zerofit.models.vision import VisionProcessor, load_vision_processor

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "data" / "demo-vlm.jsonl"


def _processor(max_image_tokens: int | None = None) -> VisionProcessor:
    cfg = config({"model": {"name_or_path": "tiny-mllama"}, "distributed": {"strategy": "single"}})
    return load_vision_processor(str(ensure_tiny_vlm("tiny-mllama")), load_tokenizer(cfg), max_image_tokens)


def test_each_image_is_one_unlabelled_token_seen_from_its_place_on() -> None:
    processor = _processor()
    data = load_vision_examples(DEMO, processor, 256)
    image_id = processor.image_token_id
    assert data.stats.n_examples == 10 and data.stats.n_dropped == 0
    per_row = [sum(t == image_id for t in e.input_ids) for e in data.examples]
    assert per_row == [1] * 6 + [0] * 4  # the sequence does not grow with the image
    tiles = []
    for example in data.examples:
        assert all(lab != image_id for lab in example.labels)
        learned = processor.tokenizer.decode([lab for lab in example.labels if lab != IGNORE_INDEX])
        assert learned.startswith("It is ") and learned.endswith("<|eot_id|>")  # the assistant text only
        if not example.images:
            continue
        mask = example.images["cross_attention_mask"][0, :, 0]  # (tokens, max tiles)
        place = example.input_ids.index(image_id)
        n_tiles = int(example.images["aspect_ratio_mask"].sum())
        tiles.append(n_tiles)
        assert mask.shape[0] == len(example.input_ids)
        assert int(mask[:place].sum()) == 0  # the prompt before the image sees no tile
        assert bool((mask[place:, :n_tiles] == 1).all()) and int(mask[:, n_tiles:].sum()) == 0
    assert sorted(set(tiles)) == [1, 2]  # tiled by their aspect ratio: images of different sizes


def test_a_micro_batch_pads_images_and_a_row_without_images_sees_none() -> None:
    processor = _processor()
    examples = load_vision_examples(DEMO, processor, 256).examples
    batch = collate([examples[0], examples[7], examples[1]], pad_id=0)  # image, text only, image
    rows, width = batch["input_ids"].shape
    assert batch["pixel_values"].shape[:3] == (rows, 1, 2)
    assert batch["cross_attention_mask"].shape == (rows, width, 1, 2)
    assert int(batch["cross_attention_mask"][1].sum()) == 0  # the text-only row: all off
    # ... with transformers' padding image: zero pixels, aspect-ratio id 0, the first tile on.
    assert float(batch["pixel_values"][1].abs().sum()) == 0.0
    assert batch["aspect_ratio_ids"][1].tolist() == [0] and batch["aspect_ratio_mask"][1].tolist() == [[1, 0]]
    assert batch["aspect_ratio_ids"][0].tolist() == examples[0].images["aspect_ratio_ids"][0].tolist()
    # A row's mask is its own, off on its padding.
    n = len(examples[0].input_ids)
    assert int(batch["cross_attention_mask"][0, n:].sum()) == 0
    assert bool((batch["cross_attention_mask"][0, :n] == examples[0].images["cross_attention_mask"][0]).all())
    assert "pixel_values" not in collate([examples[6], examples[7]], pad_id=0)  # no image: the model pads


def test_two_images_in_one_conversation_are_refused_in_one_paragraph(tmp_path: Path) -> None:
    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": str(REPO / "data" / "demo-vlm" / "red.png")},
                    {"type": "image", "image": str(REPO / "data" / "demo-vlm" / "blue.png")},
                    {"type": "text", "text": "Which two?"},
                ],
            },
            {"role": "assistant", "content": "Red and blue."},
        ]
    }
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError) as err:
        load_vision_examples(path, _processor(), 256)
    text = str(err.value)
    assert "2 images in one conversation" in text and "one image per" in text and "\n" not in text


def test_max_image_tokens_is_refused_not_ignored() -> None:
    """Mllama's images are one text token each and always the model's tiles: nothing to lower."""
    with pytest.raises(ConfigError) as err:
        _processor(max_image_tokens=16)
    text = str(err.value)
    assert "data.max_image_tokens = 16" in text and "2 tiles of 5 vision states" in text and "remove" in text
