"""Image + text conversations for vision-language models (`zerofit.data.vision`): the bundled tiny
image data through tiny-qwen2-vl's own image processor and chat template, image tokens never labelled, the
data.max_image_tokens / data.missing_images rules, and the refusals (one paragraph each)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from config_helpers import config
from zerofit.core.errors import ConfigError, DataError
from zerofit.data import IGNORE_INDEX, collate
from zerofit.data.vision import TOKEN_TYPES, VisionExample, load_vision_examples
from zerofit.models.build import load_tokenizer
from zerofit.models.tiny_vision import ensure_tiny_vlm
from zerofit.models.vision import VisionProcessor, load_vision_processor
from zerofit.objectives.kto import KTO
from zerofit.objectives.pairwise import DPO
from zerofit.objectives.sft import SFT
from zerofit.recipe.vision_settings import vision_processor_for

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "data" / "demo-vlm.jsonl"
BASE = {"model": {"name_or_path": "tiny-qwen2-vl"}, "distributed": {"strategy": "single"}}


def _processor(max_image_tokens: int | None = None) -> VisionProcessor:
    cfg = config(BASE)
    return load_vision_processor(str(ensure_tiny_vlm("tiny-qwen2-vl")), load_tokenizer(cfg), max_image_tokens)


def test_the_demo_data_loads_ragged_with_no_image_token_labelled() -> None:
    processor = _processor()
    data = load_vision_examples(DEMO, processor, 256)
    image_id = processor.image_token_id
    assert data.stats.n_examples == 10 and data.stats.n_dropped == 0 and data.stats.n_missing_images == 0
    per_row = [sum(t == image_id for t in e.input_ids) for e in data.examples]
    # Images of different sizes (56 x 56 .. 140 x 70, within 112 x 112 pixels), then the 4 text-only rows.
    assert per_row == [4, 12, 12, 10, 6, 16, 0, 0, 0, 0]
    for example, n_image in zip(data.examples, per_row, strict=True):
        assert isinstance(example, VisionExample)
        assert not any(
            t == image_id and lab != IGNORE_INDEX
            for t, lab in zip(example.input_ids, example.labels, strict=True)
        )
        learned = processor.tokenizer.decode([lab for lab in example.labels if lab != IGNORE_INDEX])
        assert learned.startswith("It is ") and learned.endswith("<|im_end|>")  # the assistant text only
        if example.images:
            # The processor's own rule: the patch grid over the 2 x 2 merge, one token each.
            assert n_image == int(example.images["image_grid_thw"].prod() // 4)
            assert example.images[TOKEN_TYPES].tolist() == [int(t == image_id) for t in example.input_ids]


def test_a_micro_batch_concatenates_images_and_pads_the_token_types() -> None:
    processor = _processor()
    examples = load_vision_examples(DEMO, processor, 256).examples
    batch = collate([examples[0], examples[7], examples[1]], pad_id=0)  # image, text only, image
    assert batch["image_grid_thw"].shape == (2, 3)
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(dim=-1).sum())
    types = batch[TOKEN_TYPES]
    assert types.shape == batch["input_ids"].shape and int(types[1].sum()) == 0
    assert int(types.sum()) == int((batch["input_ids"] == processor.image_token_id).sum())


def test_max_image_tokens_resizes_images_to_fewer_tokens() -> None:
    processor = _processor(max_image_tokens=4)
    data = load_vision_examples(DEMO, processor, 256)
    counts = [sum(t == processor.image_token_id for t in e.input_ids) for e in data.examples]
    assert max(counts) == 4
    with pytest.raises(ConfigError, match=r"data\.max_image_tokens = 1: .* at least 3136 pixels"):
        _processor(max_image_tokens=1)


@pytest.mark.parametrize(
    ("name", "limit", "most"),
    [("tiny-smolvlm", 19, 4), ("tiny-smolvlm", 20, 20), ("tiny-gemma3-vl", 16, 4)],
)
def test_max_image_tokens_bounds_the_tiles_of_the_tiled_families(name: str, limit: int, most: int) -> None:
    """SmolVLM: 4 tokens per 56-pixel tile, an image split into up to 2 x 2 tiles plus itself (20 tokens);
    a limit under 20 shrinks every image to one tile. Gemma 3: every image is 4 tokens; under one tile refused."""
    cfg = config({**BASE, "model": {"name_or_path": name}})
    path = str(ensure_tiny_vlm(name))
    processor = load_vision_processor(path, load_tokenizer(cfg), limit)
    data = load_vision_examples(DEMO, processor, 256)
    assert max(sum(t == processor.image_token_id for t in e.input_ids) for e in data.examples) == most
    with pytest.raises(ConfigError, match=r"data\.max_image_tokens = 3: .* at least 4 tokens"):
        load_vision_processor(path, load_tokenizer(cfg), 3)


def test_gemma3_pan_and_scan_crops_are_refused_in_one_paragraph(tmp_path: Path) -> None:
    folder = tmp_path / "gemma3"
    shutil.copytree(ensure_tiny_vlm("tiny-gemma3-vl"), folder)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**settings, "do_pan_and_scan": True}))
    cfg = config({**BASE, "model": {"name_or_path": "tiny-gemma3-vl"}})
    with pytest.raises(ConfigError, match=r"do_pan_and_scan on .* set \"do_pan_and_scan\": false"):
        load_vision_processor(str(folder), load_tokenizer(cfg))


def test_sharegpt_markers_render_as_openai_image_parts(tmp_path: Path) -> None:
    processor = _processor()
    image = str(REPO / "data" / "demo-vlm" / "red.png")  # an absolute path works too
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                   {"type": "text", "text": "Colour?"}]},
                      {"role": "assistant", "content": "red"}]},
        {"conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "red"}],
         "images": [image]},
        {"messages": [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "red"}],
         "images": [image]},  # no marker: the image goes before the first user text
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = load_vision_examples(path, processor, 256).examples
    assert a.input_ids == b.input_ids == c.input_ids and a.labels == b.labels == c.labels
    assert torch.equal(a.images["pixel_values"], b.images["pixel_values"])


def _with_missing(tmp_path: Path, missing: int) -> Path:
    """The demo data in `tmp_path` with `missing` of its image rows pointing at absent files."""
    shutil.copytree(REPO / "data" / "demo-vlm", tmp_path / "demo-vlm")
    lines = DEMO.read_text().splitlines()
    for i in range(missing):
        lines[i] = lines[i].replace("demo-vlm/", "demo-vlm/gone-")
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_missing_image_is_dropped_and_counted_or_refused_in_one_paragraph(tmp_path: Path) -> None:
    processor = _processor()
    path = _with_missing(tmp_path, 1)
    data = load_vision_examples(path, processor, 256)
    assert data.stats.n_missing_images == 1 and data.stats.n_examples == 9 and data.stats.n_dropped == 1
    with pytest.raises(DataError) as err:
        load_vision_examples(path, processor, 256, missing_images="error")
    message = str(err.value)
    assert "gone-red.png" in message and "data.missing_images" in message and "\n" not in message
    with pytest.raises(DataError, match=r"6 of 10 records name an image that cannot be read"):
        load_vision_examples(_with_missing(tmp_path / "many", 6), processor, 256)


def test_a_cut_inside_an_image_is_refused_with_the_fix() -> None:
    with pytest.raises(DataError, match=r"cut would fall inside an image.*data\.max_image_tokens"):
        load_vision_examples(DEMO, _processor(), 12)


def test_packing_and_objectives_without_images_are_refused_for_a_vision_model() -> None:
    """Packing and the objectives that take no images (KTO, reward models) are refused; the pairwise
    preference objectives take image pairs (`zerofit.data.vision_pairs`)."""
    cfg = config(BASE, batch={"tokens_per_micro_batch": 512})
    with pytest.raises(
        ConfigError, match=r"batch\.tokens_per_micro_batch = 512 with the vision-language model"
    ):
        vision_processor_for(cfg, load_tokenizer(cfg), SFT)
    cfg = config(BASE, train={"objective": "kto"})
    with pytest.raises(ConfigError, match=r"train\.objective = 'kto' with the vision-language model"):
        vision_processor_for(cfg, load_tokenizer(cfg), KTO)
    dpo = config(BASE, train={"objective": "dpo"})
    assert vision_processor_for(dpo, load_tokenizer(dpo), DPO) is not None
    text_cfg = config({"model": {"name_or_path": "tiny-llama"}})
    assert vision_processor_for(text_cfg, load_tokenizer(text_cfg), SFT) is None


def test_zero3_is_refused_in_one_paragraph_naming_what_works() -> None:
    """ZeRO-3 with a vision-language model aborted mid-run on 2 ranks (a gloo size mismatch): it is refused
    before any model loads, naming the preset and the engines that train vision-language models."""
    from config_helpers import config
    from zerofit.core.errors import ConfigError
    from zerofit.recipe.vision_settings import vision_processor_for

    cfg = config(
        {
            "model": {"name_or_path": "tiny-qwen2-vl"},
            "distributed": {"strategy": "deepspeed", "preset": "zero3"},
        }
    )
    with pytest.raises(ConfigError) as caught:
        vision_processor_for(cfg, None, SFT)
    text = str(caught.value)
    assert "distributed.preset = 'zero3'" in text and "zero2" in text and "fsdp" in text


def test_image_preference_pairs_load_in_trls_layout(tmp_path: Path) -> None:
    """TRL's vision DPO records: each side is the prompt (its image expanded to its tokens, unlabelled) then
    the side's answer (labelled), both holding the record's image; a pair's micro-batch rows carry the images
    in row order (chosen rows, then rejected rows); an unreadable image is refused in one paragraph."""
    from zerofit.data.pairs import collate_pairs
    from zerofit.data.vision_pairs import load_vision_pairs

    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    rows = [
        {"images": [f"demo-vlm/{a}.png"], "prompt": prompt, "chosen": [{"role": "assistant", "content": a}],
         "rejected": [{"role": "assistant", "content": b}]}
        for a, b in (("red", "blue"), ("green", "white"))
    ]  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    shutil.copytree(REPO / "data" / "demo-vlm", tmp_path / "demo-vlm")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = _processor(16)
    data = load_vision_pairs(path, processor, 128)
    assert data.stats.n_examples == 2 and data.stats.format == "preference"
    pair = data.examples[0]
    for side, answer in ((pair.chosen, "red"), (pair.rejected, "blue")):
        assert isinstance(side, VisionExample) and "pixel_values" in side.images
        learned = [t for t, label in zip(side.input_ids, side.labels, strict=True) if label != IGNORE_INDEX]
        assert answer in processor.tokenizer.decode(learned)
        assert processor.image_token_id not in learned
    assert torch.equal(pair.chosen.images["pixel_values"], pair.rejected.images["pixel_values"])
    batch = collate_pairs(data.examples, 0)
    rows = [side.images["pixel_values"] for p in data.examples for side in (p.chosen, p.rejected)]
    order = [rows[0], rows[2], rows[1], rows[3]]  # chosen rows, then rejected rows
    assert torch.equal(batch["pixel_values"], torch.cat(order)) and batch["image_grid_thw"].shape[0] == 4
    (tmp_path / "demo-vlm" / "green.png").unlink()
    with pytest.raises(DataError, match=r"image .*green\.png.* cannot be read"):
        load_vision_pairs(path, processor, 128)
