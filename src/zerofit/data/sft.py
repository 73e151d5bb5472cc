"""Supervised fine-tuning records: read prompt/response JSONL, tokenize, mask the prompt, truncate.

Each line becomes an `Example` (input ids and unshifted labels, IGNORE_INDEX on bos and prompt tokens);
`DataStats` says what loading did to the file. Every problem raises `DataError` naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.errors import DataError
from zerofit.loss import IGNORE_INDEX


@dataclass
class Example:
    """One tokenized training sequence; `labels` is IGNORE_INDEX on bos and prompt tokens (not shifted: HF-style)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class DataStats:
    """What loading did to the file: lines read, examples kept, truncated, and dropped (no response left)."""

    n_lines: int
    n_examples: int
    n_truncated: int
    n_dropped: int


def _parse_line(raw: bytes, path: Path, lineno: int) -> tuple[str, str] | None:
    """(prompt, response) of one JSONL line, None for a blank line, DataError naming file:line otherwise."""
    where = f"{path}:{lineno}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start}); save the file as UTF-8."
        ) from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object "
            'like {"prompt": "...", "response": "..."}.'
        ) from None
    if not isinstance(obj, dict):
        raise DataError(
            f"{where}: expected a JSON object with string keys 'prompt' and 'response', got a "
            f"{type(obj).__name__}."
        )
    values: list[str] = []
    for key in ("prompt", "response"):
        if key not in obj:
            present = ", ".join(repr(k) for k in obj) or "none"
            raise DataError(
                f"{where}: missing key {key!r} (keys present: {present}); each line needs string keys "
                "'prompt' and 'response'."
            )
        if not isinstance(obj[key], str):
            raise DataError(
                f"{where}: {key!r} must be a string, got {type(obj[key]).__name__} ({obj[key]!r:.60}); "
                "convert it to text in the data file."
            )
        values.append(obj[key])
    return values[0], values[1]


def tokenize_example(
    prompt: str, response: str, tokenizer: Any, max_seq_len: int
) -> tuple[Example, bool, int]:
    """Tokenize one pair as [bos] + prompt + response + [eos], truncated to `max_seq_len`.

    Returns (example, was_truncated, prompt_length_with_bos). Labels are IGNORE_INDEX on bos and prompt, the token
    ids on response and eos; a tokenizer without a bos token simply gets none.
    """
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt_ids = bos + tokenizer.encode(prompt, add_special_tokens=False)
    response_ids = [*tokenizer.encode(response, add_special_tokens=False), tokenizer.eos_token_id]
    input_ids = prompt_ids + response_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
    truncated = len(input_ids) > max_seq_len
    return Example(input_ids[:max_seq_len], labels[:max_seq_len]), truncated, len(prompt_ids)


def load_sft_dataset(path: str | Path, tokenizer: Any, max_seq_len: int) -> tuple[list[Example], DataStats]:
    """Read a prompt/response JSONL file into masked, truncated examples, plus counts of what happened.

    Blank lines are skipped. An example whose response is truncated away entirely has nothing to learn and
    is dropped (counted). Every problem raises `DataError` naming the file and, where it applies, the line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"data.path = {str(path)!r}: file does not exist; point data.path at a JSONL file with one "
            '{"prompt": ..., "response": ...} object per line.'
        )
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"{path}: the tokenizer has no eos token, so responses cannot be terminated; use a model whose "
            "tokenizer defines eos_token."
        )
    examples: list[Example] = []
    n_lines = n_truncated = n_dropped = 0
    longest_prompt = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            n_lines = lineno
            pair = _parse_line(raw, path, lineno)
            if pair is None:
                continue
            example, truncated, prompt_len = tokenize_example(*pair, tokenizer, max_seq_len)
            longest_prompt = max(longest_prompt, prompt_len)
            if all(label == IGNORE_INDEX for label in example.labels):
                n_dropped += 1
                continue
            n_truncated += truncated
            examples.append(example)
    if not examples and n_dropped == 0:
        raise DataError(
            f"{path}: no examples (the file has {n_lines} lines, none with data); add lines of the form "
            '{"prompt": "...", "response": "..."}.'
        )
    if not examples:
        raise DataError(
            f"{path}: all {n_dropped} examples were dropped because data.max_seq_len = {max_seq_len} leaves "
            f"no room for any response token (the longest prompt is {longest_prompt} tokens including bos); "
            f"set data.max_seq_len to at least {longest_prompt + 2} (prompt + one response token + eos)."
        )
    stats = DataStats(n_lines=n_lines, n_examples=len(examples), n_truncated=n_truncated, n_dropped=n_dropped)
    return examples, stats
