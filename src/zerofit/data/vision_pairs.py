"""Preference pairs with images for a vision-language model (DPO, SimPO, ORPO, CPO), TRL's layout:

    {"images": ["imgs/red.png"],
     "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
     "chosen": [{"role": "assistant", "content": "red"}], "rejected": [{"role": "assistant", "content": "blue"}]}

The prompt's messages are followed by the chosen (then the rejected) messages, and each conversation is
tokenized as a supervised vision conversation is (`zerofit.data.vision.tokenize_vision`: the images expanded
to their tokens, the loss on the assistant's text only), so a pair is two `VisionExample`s that hold the same
images; a micro-batch's rows carry them in row order (`zerofit.data.pairs.collate_pairs`). An image that
cannot be read, or a response with no label left within `data.max_seq_len`, is refused in one paragraph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError
from zerofit.data.pairs import PreferencePair
from zerofit.data.sft import DataStats, TokenizedData, has_labels
from zerofit.data.vision import open_record_images, tokenize_vision, vision_messages
from zerofit.data.vision_sources import open_vision_source

__all__ = ["load_vision_pairs"]


def _turns(record: dict[str, Any], key: str, where: str) -> list[Any]:
    """The record's `key` as a list of messages (a string: one message of the prompt's user or the
    response's assistant)."""
    value = record.get(key)
    if isinstance(value, str):
        return [{"role": "user" if key == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: {key!r} is {type(value).__name__ if value is not None else 'missing'}; preference pairs "
            "for a vision-language model are TRL's: {'images': [...], 'prompt': [messages with image parts], "
            "'chosen': [assistant messages], 'rejected': [assistant messages]}."
        )
    return value


class _PairLoad:
    """Turns a source's records into pairs of `VisionExample`s, counting what happens."""

    def __init__(self, processor: Any, max_seq_len: int, base: Path) -> None:
        self.processor, self.max_seq_len, self.base = processor, max_seq_len, base
        self.pairs: list[PreferencePair] = []
        self.records: list[int] = []
        self.n_truncated = 0

    def add(self, index: int, where: str, record: dict[str, Any]) -> None:
        images = {k: record[k] for k in ("image", "images") if k in record}
        sides = []
        for key in ("chosen", "rejected"):
            turns = _turns(record, "prompt", where) + _turns(record, key, where)
            messages, refs = vision_messages({"messages": turns, **images}, where)
            opened = open_record_images(refs, self.base, self.processor.pixel_bound, where)
            example, cut = tokenize_vision(self.processor, messages, opened, self.max_seq_len, where)
            if not has_labels(example.labels):
                raise DataError(
                    f"{where}: the {key} response has no token left to learn within data.max_seq_len = "
                    f"{self.max_seq_len} (its prompt and images fill it); raise data.max_seq_len or lower "
                    "data.max_image_tokens."
                )
            self.n_truncated += int(cut)
            sides.append(example)
        self.pairs.append(PreferencePair(sides[0], sides[1]))
        self.records.append(index)


def load_vision_pairs(
    path: str | Path,
    processor: Any,
    max_seq_len: int,
    *,
    split: str = "train",
    subset: str | None = None,
    key: str = "data.path",
) -> TokenizedData[PreferencePair]:
    """The preference pairs of `path` (module docstring) for the model of `processor`."""
    source, base = open_vision_source(path, split=split, subset=subset, key=key)
    load = _PairLoad(processor, max_seq_len, base)
    for index, (where, record) in enumerate(source):
        load.add(index, where, record)
    if not load.pairs:
        raise DataError(f"{source.describe()}: no preference pairs; add records in TRL's vision layout.")
    stats = DataStats(
        source.rows, len(load.pairs), load.n_truncated, 0, format="preference", source=source.describe()
    )
    return TokenizedData(load.pairs, stats, load.records)
