"""Image prompts of an online-RL run on a vision-language model (`train.objective: grpo`), TRL's layout:

    {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
     "image": "imgs/red.png", "answer": "red"}

The prompt is a list of messages whose user content holds image parts; a bare `{"type": "image"}` part takes
the record's next image (`image`, one, or `images`, a list; paths relative to the data file's folder, as
for supervised vision data: `zerofit.data.vision`). The prompt is rendered with the chat template's generation
prompt and each image's placeholder expanded to its tokens by the model's processor, exactly as a training
conversation's; every key other than `prompt` is a column for the reward functions (the image references
included). An image prompt is never cut (a cut image cannot be read): one longer than
`rl.max_prompt_length` tokens is refused in one paragraph, and so is an image that cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import DataError
from zerofit.data.prompts import PROMPT_KEY, PromptData, PromptExample
from zerofit.data.sft import DataStats
from zerofit.data.vision import open_record_images, prompt_inputs, vision_messages
from zerofit.data.vision_sources import open_vision_source

__all__ = ["VisionPrompt", "load_vision_prompts"]


@dataclass(frozen=True)
class VisionPrompt(PromptExample):
    """A `PromptExample` with its images' model inputs (the processor's pixel tensors, and its per-token
    types, one per prompt token)."""

    images: dict[str, torch.Tensor] = field(default_factory=dict)


def _messages(record: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """The record's prompt as template messages and its image references (`vision_messages`' rules)."""
    value = record.get(PROMPT_KEY)
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: the prompt is {type(value).__name__ if value is not None else 'missing'}; an online-RL run "
            "on a vision-language model reads TRL's image prompts: {'prompt': [{'role': 'user', 'content': "
            "[{'type': 'image'}, {'type': 'text', 'text': '...'}]}], 'image': 'path.png', ...}."
        )
    images = {k: record[k] for k in ("image", "images") if k in record}
    return vision_messages({"messages": value, **images}, where)


def _one(
    processor: Any, record: dict[str, Any], where: str, base: Path, limit: int, index: int
) -> VisionPrompt:
    """One record as a `VisionPrompt`, its images opened and processed; refused when they cannot be read or
    the prompt is longer than `limit` tokens."""
    messages, refs = _messages(record, where)
    opened = open_record_images(refs, base, processor.pixel_bound, where)
    ids, pixels = prompt_inputs(processor, messages, opened, where)
    if len(ids) > limit:
        raise DataError(
            f"{where}: the prompt is {len(ids)} tokens with its images, more than rl.max_prompt_length = {limit}, "
            "and an image prompt is never cut (a cut image cannot be read); raise rl.max_prompt_length or "
            "lower data.max_image_tokens."
        )
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    columns = {k: v for k, v in record.items() if k != PROMPT_KEY}
    return VisionPrompt(ids, text, columns, index, messages, images=pixels)


def load_vision_prompts(
    path: str | Path,
    processor: Any,
    max_prompt_length: int,
    *,
    split: str = "train",
    subset: str | None = None,
    key: str = "data.path",
) -> PromptData:
    """The image prompts of `path` (module docstring) for the model of `processor`."""
    source, base = open_vision_source(path, split=split, subset=subset, key=key)
    prompts: list[PromptExample] = []
    names: dict[str, None] = {}
    for index, (where, record) in enumerate(source):
        prompt = _one(processor, record, where, base, max_prompt_length, index)
        names.update(dict.fromkeys(prompt.columns))
        prompts.append(prompt)
    if not prompts:
        raise DataError(f"{source.describe()}: no prompts; add records in TRL's image-prompt layout.")
    stats = DataStats(
        source.rows, len(prompts), 0, 0, format="conversational prompt", source=source.describe()
    )
    return PromptData(prompts, stats, list(names))
