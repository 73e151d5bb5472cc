"""Online RL on a vision-language model (tiny-qwen2-vl): image prompts in TRL's layout, the sampler's KV-cache
decoding at the M-RoPE positions the training forward computes, and the refusals (one paragraph each)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from config_helpers import config
from zerofit.core.errors import ConfigError, DataError
from zerofit.data.vision_prompts import VisionPrompt, load_vision_prompts
from zerofit.loop.rollout import SamplingSettings, _decode, _prefill, micro_batch
from zerofit.models.build import load_tokenizer
from zerofit.models.tiny_vision import ensure_tiny_vlm
from zerofit.models.vision import VisionProcessor, load_vision_processor
from zerofit.objectives.grpo import GRPO
from zerofit.objectives.grpo.loss import grpo_inputs
from zerofit.recipe.vision_settings import vision_processor_for

REPO = Path(__file__).resolve().parents[3]
IMAGES = REPO / "data" / "demo-vlm"  # six PNGs of different sizes (so different image-token counts)
BASE = {"model": {"name_or_path": "tiny-qwen2-vl"}, "distributed": {"strategy": "single"}}


def _processor() -> VisionProcessor:
    cfg = config(BASE)
    return load_vision_processor(str(ensure_tiny_vlm("tiny-qwen2-vl")), load_tokenizer(cfg), 16)


def _write(tmp_path: Path, names: list[str], **extra: Any) -> Path:
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
            "image": str(IMAGES / f"{name}.png"),
            "answer": name,
            **extra,
        }
        for name in names
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_image_prompts_load_in_trls_layout(tmp_path: Path) -> None:
    """Each image's placeholder expanded to its tokens (none cut), the per-token types one per prompt token,
    the other keys columns; too long a prompt and an unreadable image refused in one paragraph."""
    processor = _processor()
    data = load_vision_prompts(_write(tmp_path, ["red", "blue"]), processor, 64)
    assert [p.columns["answer"] for p in data.prompts] == ["red", "blue"]
    first = data.prompts[0]
    assert isinstance(first, VisionPrompt) and data.stats.format == "conversational prompt"
    types = first.images["mm_token_type_ids"]
    assert len(types) == len(first.input_ids) and int(types.sum()) == first.input_ids.count(
        processor.image_token_id
    )
    assert int(types.sum()) > 1 and "Colour?" in first.text
    with pytest.raises(DataError, match=r"more than rl\.max_prompt_length = 8.*never cut"):
        load_vision_prompts(_write(tmp_path, ["red"]), processor, 8)
    with pytest.raises(DataError, match=r"image .*nope\.png.* cannot be read"):
        load_vision_prompts(_write(tmp_path, ["nope"]), processor, 64)


def test_cached_decoding_is_at_the_training_forwards_positions(tmp_path: Path) -> None:
    """Two image prompts of different lengths (left padding), each continued by the same 5 tokens: the
    sampler's prefill and KV-cache decoding give the logits of the training forward over prompt + completion
    (the model's own M-RoPE from the mask and types, `micro_batch` / `grpo_inputs`). Plain 1-D positions in
    the decoding steps give other logits: the check sees the positions."""
    from transformers import AutoModelForImageTextToText

    processor = _processor()
    prompts = load_vision_prompts(_write(tmp_path, ["red", "white"]), processor, 64).prompts
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(ensure_tiny_vlm("tiny-qwen2-vl"), dtype=torch.float32)
    model.eval()
    continuation = [[5, 9, 12, 7, 30], [5, 9, 12, 7, 30]]
    ids = [p.input_ids for p in prompts]
    images = [p.images for p in prompts]  # type: ignore[attr-defined]
    batch = micro_batch(ids, continuation, [True, True], torch.zeros(2), 0, images=images)
    assert "position_ids" not in batch
    width = max(map(len, ids))
    with torch.no_grad():
        whole = model(**grpo_inputs(batch, torch.device("cpu"))).logits[:, width - 1 : -1]
        for offsets in (True, False):
            s = SamplingSettings(5, (), 0)
            last, state = _prefill(model, ids, s, torch.device("cpu"), images)
            assert state.rope is not None and bool((state.rope != 0).any())
            state.rope = state.rope if offsets else None
            steps = [last]
            for t in range(4):
                tokens = torch.tensor([c[t] for c in continuation])
                steps.append(_decode(model, tokens, state, width + t + 1))
            cached = torch.stack(steps, dim=1)
            close = torch.allclose(cached, whole, atol=1e-4)
            assert close if offsets else not close, (cached - whole).abs().max()


def test_grpo_samples_image_prompts_of_the_qwen2_vl_family_only() -> None:
    tokenizer = load_tokenizer(config(BASE))
    assert vision_processor_for(config(BASE, train={"objective": "grpo"}), tokenizer, GRPO) is not None
    llava = {"model": {"name_or_path": "tiny-llava"}, "train": {"objective": "grpo"}}
    with pytest.raises(ConfigError, match=r"Qwen2-VL family only .*'llava'"):
        vision_processor_for(config(llava), load_tokenizer(config(llava)), GRPO)
