"""The tokenization cache for image + text data (`zerofit.data.vision_cache`): keyed on the images'
bytes and the processor's limits too, the pixel tensors stored as safetensors (no pickle) and checked before
use; an edited image or a changed limit misses, a corrupted entry is refused and rebuilt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from config_helpers import config
from zerofit.data.cache import entry_dir
from zerofit.data.vision import TOKEN_TYPES, VisionExample, load_vision_examples
from zerofit.data.vision_cache import IMAGES_FILE, load_vision_cached, save_vision_cached
from zerofit.models.build import load_tokenizer
from zerofit.models.tiny import cache_dir
from zerofit.models.tiny_vision import ensure_tiny_vlm
from zerofit.models.vision import VisionProcessor, load_vision_processor

REPO = Path(__file__).resolve().parents[3]
BASE = {"model": {"name_or_path": "tiny-qwen2-vl"}, "distributed": {"strategy": "single"}}


def _processor(max_image_tokens: int | None = None, name: str = "tiny-qwen2-vl") -> VisionProcessor:
    cfg = config({**BASE, "model": {"name_or_path": name}})
    return load_vision_processor(str(ensure_tiny_vlm(name)), load_tokenizer(cfg), max_image_tokens)


def _data(tmp_path: Path) -> Path:
    """The demo image data in `tmp_path`, with one row naming `tmp_path` so its cache entries are its own."""
    shutil.copytree(REPO / "data" / "demo-vlm", tmp_path / "demo-vlm")
    own = {"messages": [{"role": "user", "content": str(tmp_path)}, {"role": "assistant", "content": "ok"}]}
    path = tmp_path / "data.jsonl"
    path.write_text((REPO / "data" / "demo-vlm.jsonl").read_text() + json.dumps(own) + "\n")
    return path


def _entries() -> set[Path]:
    folder = cache_dir() / "tokenized"
    return {p for p in folder.iterdir() if not p.name.startswith(".")} if folder.is_dir() else set()


def _own_entry(before: set[Path], tmp_path: Path) -> Path:
    """The one entry written since `before` for data under `tmp_path`: the cache folder is shared, so
    other tests running beside this one may add entries of their own meanwhile."""

    def source(entry: Path) -> str:
        try:
            return json.loads((entry / "meta.json").read_text())["stats"]["source"]
        except OSError:  # another test's entry, removed meanwhile
            return ""

    (entry,) = (e for e in _entries() - before if str(tmp_path) in source(e))
    return entry


def _same(a: list[VisionExample], b: list[VisionExample]) -> bool:
    return [(x.input_ids, x.labels, sorted(x.images)) for x in a] == [
        (y.input_ids, y.labels, sorted(y.images)) for y in b
    ] and all(torch.equal(x.images[k], y.images[k]) for x, y in zip(a, b, strict=True) for k in x.images)


def test_a_second_read_is_a_hit_and_an_edited_image_or_limit_a_miss(tmp_path: Path) -> None:
    processor, path = _processor(), _data(tmp_path)
    before = _entries()
    first = load_vision_examples(path, processor, 256, cache=True)
    entry = _own_entry(before, tmp_path)
    assert sorted(p.name for p in entry.iterdir()) == [
        IMAGES_FILE, "input_ids.npy", "label_mask.npy", "meta.json", "offsets.npy", "records.npy",
    ]  # fmt: skip
    again = load_vision_examples(path, processor, 256, cache=True)
    assert not first.stats.from_cache and again.stats.from_cache and again.records == first.records
    assert _same(first.examples, again.examples) and again.stats.n_examples == 11  # type: ignore[arg-type]
    # The same size, so the same tokens: only the pixels (and the image's bytes) differ.
    Image.new("RGB", Image.open(tmp_path / "demo-vlm" / "red.png").size, (9, 9, 9)).save(
        tmp_path / "demo-vlm" / "red.png"
    )
    edited = load_vision_examples(path, processor, 256, cache=True)
    assert not edited.stats.from_cache
    assert edited.examples[0].input_ids == first.examples[0].input_ids
    assert not torch.equal(
        edited.examples[0].images["pixel_values"], first.examples[0].images["pixel_values"]
    )
    limited = load_vision_examples(path, _processor(max_image_tokens=4), 256, cache=True)
    assert not limited.stats.from_cache and len(limited.examples[1].input_ids) < len(
        edited.examples[1].input_ids
    )
    assert load_vision_examples(path, processor, 200, cache=True).stats.from_cache is False  # max_seq_len


def test_a_corrupted_entry_is_refused_with_a_note_and_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    processor, path = _processor(), _data(tmp_path)
    before = _entries()
    first = load_vision_examples(path, processor, 256, cache=True)
    entry = _own_entry(before, tmp_path)
    blob = bytearray((entry / IMAGES_FILE).read_bytes())
    blob[-1] ^= 0xFF  # a pixel value changed
    (entry / IMAGES_FILE).write_bytes(bytes(blob))
    capsys.readouterr()
    rebuilt = load_vision_examples(path, processor, 256, cache=True)
    note = capsys.readouterr().err
    assert not rebuilt.stats.from_cache and str(entry) in note and "content digest" in note
    assert _same(first.examples, rebuilt.examples)  # type: ignore[arg-type]
    assert load_vision_examples(path, processor, 256, cache=True).stats.from_cache  # replaced, sound again


def test_image_tensors_that_do_not_make_their_image_tokens_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An entry whose digest is sound but whose tensors contradict its ids (written so: a grid of another
    size) is refused by the claims check and removed."""
    processor, path = _processor(), _data(tmp_path)
    data = load_vision_examples(path, processor, 256)
    wrong = data.examples[0]
    grid = wrong.images["image_grid_thw"].clone()  # type: ignore[attr-defined]
    grid[0, 1] += 2
    examples = [VisionExample(wrong.input_ids, wrong.labels, {**wrong.images, "image_grid_thw": grid})]  # type: ignore[attr-defined]
    key = f"test-claims-{tmp_path.name}"
    save_vision_cached(key, examples, [0], {"stats": {}}, processor.tokenizer)
    assert load_vision_cached(key, processor, TOKEN_TYPES) is None
    note = capsys.readouterr().err
    assert "example 0's images make" in note and "image tokens where its ids hold" in note
    assert not entry_dir(key).exists()


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-gemma3-vl", "tiny-smolvlm", "tiny-mllama"])
def test_every_family_reads_back_what_it_cached(tmp_path: Path, name: str) -> None:
    """Each family's tensors differ in shape per example beyond their first dimension (SmolVLM's tiles,
    Mllama's cross-attention masks), and some rows hold only token types (Gemma 3): the entry stores each
    example's shape and is read back tensor for tensor, and checked by the family's own image-token rule."""
    processor, path = _processor(name=name), _data(tmp_path)
    first = load_vision_examples(path, processor, 256, cache=True)
    second = load_vision_examples(path, processor, 256, cache=True)
    assert not first.stats.from_cache and second.stats.from_cache
    assert _same(first.examples, second.examples)


def test_pixels_rewritten_with_a_matching_digest_are_read_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An entry whose image tensors were rewritten (every pixel negated: the shapes, so the claims check,
    still hold) and whose digest was recomputed with zerofit's own function is caught by the sample check
    against the source: the data is read again, one note names the entry, and the rebuilt entry
    serves the next read."""
    from safetensors.torch import load_file, save_file

    from zerofit.data import cache as cache_module

    processor, path = _processor(), _data(tmp_path)
    before = _entries()
    first = load_vision_examples(path, processor, 256, cache=True)
    entry = _own_entry(before, tmp_path)
    tensors = load_file(entry / IMAGES_FILE)
    tensors["pixel_values"] = -tensors["pixel_values"]
    save_file(tensors, entry / IMAGES_FILE)
    meta = json.loads((entry / "meta.json").read_text())
    meta["digest"] = cache_module._content_digest(entry, {k: v for k, v in meta.items() if k != "digest"})
    (entry / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    rebuilt = load_vision_examples(path, processor, 256, cache=True)
    note = capsys.readouterr().err
    assert not rebuilt.stats.from_cache and _same(first.examples, rebuilt.examples)  # type: ignore[arg-type]
    assert note.startswith(f"zerofit: {entry} does not match its source (record 0 of {path}")
    assert "images.pixel_values" in note and note.count("\n") == 1
    again = load_vision_examples(path, processor, 256, cache=True)
    assert again.stats.from_cache and capsys.readouterr().err == ""
