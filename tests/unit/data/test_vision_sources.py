"""Image data from `datasets` (`zerofit.data.vision_sources`): a `save_to_disk` folder or a Parquet
file with a `messages` column and an `images` column of `datasets.Image` values, and an `imagefolder` folder
(images and a metadata.jsonl), through the same processor path as local image files; a null or undecodable
image follows `data.missing_images`, and a folder of another layout is one paragraph naming the ones read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from config_helpers import config
from zerofit.core.errors import DataError
from zerofit.data.vision import load_vision_examples
from zerofit.models.build import load_tokenizer
from zerofit.models.tiny_vision import ensure_tiny_vlm
from zerofit.models.vision import VisionProcessor, load_vision_processor

REPO = Path(__file__).resolve().parents[3]
IMAGES = REPO / "data" / "demo-vlm"
BASE = {"model": {"name_or_path": "tiny-qwen2-vl"}, "distributed": {"strategy": "single"}}
QUESTION = "What colour is this image?"


def _processor() -> VisionProcessor:
    cfg = config(BASE)
    return load_vision_processor(str(ensure_tiny_vlm("tiny-qwen2-vl")), load_tokenizer(cfg), None)


def _turns(colour: str, image: bool = True) -> list[dict[str, object]]:
    """A TRL-layout conversation: a bare image part takes the record's next `images` entry."""
    user = [{"type": "image", "text": None}] if image else []
    user.append({"type": "text", "text": QUESTION})
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": f"It is {colour}."}]}]  # fmt: skip


def _dataset(images: list[list[bytes | None]], colours: list[str]) -> object:
    import datasets

    features = datasets.Features(
        {
            "messages": datasets.List(
                {
                    "role": datasets.Value("string"),
                    "content": datasets.List(
                        {"type": datasets.Value("string"), "text": datasets.Value("string")}
                    ),
                }
            ),
            "images": datasets.List(datasets.Image()),
        }
    )
    rows = {
        "messages": [_turns(c, bool(imgs)) for c, imgs in zip(colours, images, strict=True)],
        "images": [[None if b is None else {"bytes": b, "path": None} for b in imgs] for imgs in images],
    }
    return datasets.Dataset.from_dict(rows, features=features)


def _reference(processor: VisionProcessor, tmp_path: Path, colours: list[str]) -> list[object]:
    """The same conversations as a JSONL file naming the image files."""
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": str(IMAGES / f"{c}.png")},
                                                   {"type": "text", "text": QUESTION}]},
                      {"role": "assistant", "content": f"It is {c}."}]}
        for c in colours
    ]  # fmt: skip
    path = tmp_path / "reference.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_vision_examples(path, processor, 256).examples


def test_a_saved_dataset_and_parquet_with_image_columns_read_as_the_files_do(tmp_path: Path) -> None:
    processor = _processor()
    colours = ["red", "green", "blue"]
    data = _dataset([[(IMAGES / f"{c}.png").read_bytes()] for c in colours] + [[]], [*colours, "white"])
    data.save_to_disk(str(tmp_path / "saved"))  # type: ignore[attr-defined]
    data.to_parquet(str(tmp_path / "rows.parquet"))  # type: ignore[attr-defined]
    expected = _reference(processor, tmp_path, colours)
    for source in (tmp_path / "saved", tmp_path / "rows.parquet"):
        loaded = load_vision_examples(source, processor, 256, cache=True)
        assert loaded.stats.n_examples == 4 and loaded.stats.n_missing_images == 0
        for got, want in zip(loaded.examples, expected, strict=False):
            assert got.input_ids == want.input_ids and got.labels == want.labels  # type: ignore[attr-defined]
            assert torch.equal(got.images["pixel_values"], want.images["pixel_values"])  # type: ignore[attr-defined]
        assert not loaded.examples[3].images  # type: ignore[attr-defined]  # the text-only row
        assert load_vision_examples(source, processor, 256, cache=True).stats.from_cache


def test_a_null_or_undecodable_image_in_a_dataset_follows_missing_images(tmp_path: Path) -> None:
    processor = _processor()
    red, green = ((IMAGES / f"{c}.png").read_bytes() for c in ("red", "green"))
    data = _dataset([[red], [None], [b"not an image"], [green]], ["red", "blue", "white", "green"])
    data.save_to_disk(str(tmp_path / "saved"))  # type: ignore[attr-defined]
    loaded = load_vision_examples(tmp_path / "saved", processor, 256)
    assert (loaded.stats.n_examples, loaded.stats.n_missing_images, loaded.records) == (2, 2, [0, 3])
    with pytest.raises(DataError) as err:
        load_vision_examples(tmp_path / "saved", processor, 256, missing_images="error")
    message = str(err.value)
    assert "row 2" in message and "a null image" in message and "data.missing_images" in message
    assert "\n" not in message


def test_a_null_image_column_leaves_a_text_only_row_one_and_misses_an_image_its_text_names(
    tmp_path: Path,
) -> None:
    """LLaVA-style rows (one `image`): null on a text-only row, which trains; null where `<image>` asks for
    one, a missing image."""
    rows = [
        {"image": None, "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
        {"image": None, "conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "Red."}]},
        {"image": str(IMAGES / "red.png"),
         "conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "Red."}]},
    ]  # fmt: skip
    path = tmp_path / "llava.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_vision_examples(path, _processor(), 256)
    assert (loaded.records, loaded.stats.n_missing_images) == ([0, 2], 1)
    assert not loaded.examples[0].images and loaded.examples[1].images  # type: ignore[attr-defined]


def _image_folder(folder: Path, rows: list[dict[str, object]]) -> Path:
    folder.mkdir()
    for colour in ("red", "green", "blue"):
        shutil.copy(IMAGES / f"{colour}.png", folder / f"{colour}.png")
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_an_image_folder_reads_its_metadata_conversations(tmp_path: Path) -> None:
    processor = _processor()
    rows = [
        {"file_name": f"{c}.png", "messages": [{"role": "user", "content": QUESTION},
                                               {"role": "assistant", "content": f"It is {c}."}]}
        for c in ("red", "green", "blue")
    ]  # fmt: skip
    folder = _image_folder(tmp_path / "folder", rows)
    loaded = load_vision_examples(folder, processor, 256, cache=True)
    expected = _reference(processor, tmp_path, ["red", "green", "blue"])
    by_tokens = sorted(((e.input_ids, e.labels) for e in loaded.examples), key=str)
    assert by_tokens == sorted(((e.input_ids, e.labels) for e in expected), key=str)  # type: ignore[attr-defined]
    assert "image folder" in loaded.stats.source
    (folder / "red.png").write_bytes(b"broken")  # undecodable now: a missing image, and a cache miss
    again = load_vision_examples(folder, processor, 256, cache=True)
    assert not again.stats.from_cache and again.stats.n_missing_images == 1 and again.stats.n_examples == 2


def test_a_folder_of_another_layout_is_one_paragraph_naming_the_layouts_read(tmp_path: Path) -> None:
    folder = tmp_path / "pictures"
    folder.mkdir()
    shutil.copy(IMAGES / "red.png", folder / "red.png")
    with pytest.raises(DataError) as err:
        load_vision_examples(folder, _processor(), 256)
    message = str(err.value)
    assert "data.path" in message and "metadata.jsonl" in message and "save_to_disk" in message
    assert "'file_name' and 'messages'" in message and "\n" not in message
    captions = _image_folder(tmp_path / "captions", [{"file_name": "red.png", "text": "red"}])
    with pytest.raises(DataError, match=r"row 1: no 'messages'.*metadata\.jsonl"):
        load_vision_examples(captions, _processor(), 256)
