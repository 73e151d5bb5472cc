"""Training data: read prompt/response JSONL, mask prompts, order global batches, split them, collate.

The order of global batches depends only on the seed and the data, never on how a global batch is split
into micro-batches x accumulation steps x data-parallel ranks: a global batch is a fixed slice of a seeded
permutation (`GlobalBatchSampler`), and only then divided among ranks and micro-steps
(`split_global_batch`). That is what makes runs with different splits comparable step by step.

No torch.distributed here: the strategy owns communication; this module is pure per-rank logic.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from zerofit.errors import DataError

IGNORE_INDEX = -100  # label value the loss skips (prompt tokens, padding)


@dataclass
class Example:
    """One tokenized training sequence; `labels` is -100 on bos and prompt tokens (not shifted: HF-style)."""

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

    Returns (example, was_truncated, prompt_length_with_bos). Labels are -100 on bos and prompt, the token
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


class GlobalBatchSampler:
    """Which examples form global batch number `step`: a pure function of (seed, data size, step).

    Each epoch is its own seeded permutation; it yields floor(n / gbs) full global batches, then its
    remainder is either dropped (`partial_window="drop"`) or yielded as one short batch ("normalize").
    A remainder never leaks into the next epoch. Because `batch_indices(step)` depends on nothing else,
    resuming at step k needs no sampler state.
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
        partial_window: Literal["drop", "normalize"] = "drop",
    ) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if partial_window not in ("drop", "normalize"):
            raise ValueError(f"partial_window must be 'drop' or 'normalize', got {partial_window!r}")
        if num_examples < 1:
            raise DataError("the dataset has no examples; add prompt/response lines to data.path.")
        if num_examples < global_batch_size and partial_window == "drop":
            raise DataError(
                f"the dataset has {num_examples} examples, fewer than batch.global_batch_size = "
                f"{global_batch_size}, so not one full global batch can be formed and "
                "train.partial_window = 'drop' would drop them all; add data, lower "
                "batch.global_batch_size, or set train.partial_window=normalize."
            )
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.partial_window = partial_window
        self.full_batches_per_epoch = num_examples // global_batch_size
        self.remainder = num_examples % global_batch_size
        has_partial = partial_window == "normalize" and self.remainder > 0
        self.steps_per_epoch: int = self.full_batches_per_epoch + int(has_partial)
        self._cached: tuple[int, tuple[int, ...]] | None = None  # (epoch, permutation) of the last lookup

    def _permutation(self, epoch: int) -> tuple[int, ...]:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        order = list(range(self.num_examples))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by `random.Random`: identical in every process and
            # Python version, and (unlike seed + epoch) seed s epoch 1 never equals seed s+1 epoch 0.
            random.Random(f"zerofit-sampler:{self.seed}:{epoch}").shuffle(order)
        self._cached = (epoch, tuple(order))
        return self._cached[1]

    def epoch_of(self, step: int) -> int:
        """The epoch (0-based) that global batch `step` belongs to."""
        return step // self.steps_per_epoch

    def is_partial(self, step: int) -> bool:
        """True for the short remainder batch that ends an epoch under `partial_window="normalize"`."""
        return step % self.steps_per_epoch == self.full_batches_per_epoch

    def batch_indices(self, step: int) -> list[int]:
        """Example indices of global batch `step` (0-based); full batches have exactly global_batch_size."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        k = step % self.steps_per_epoch
        start = k * self.global_batch_size
        stop = min(start + self.global_batch_size, self.num_examples)
        return list(self._permutation(self.epoch_of(step))[start:stop])


def split_global_batch(
    indices: list[int], micro_batch_size: int, grad_accum_steps: int, dp_size: int, rank: int
) -> list[list[int]]:
    """This rank's micro-batches of one global batch: exactly `grad_accum_steps` lists.

    Micro-step j of rank r gets indices[(j*dp + r)*mbs : (j*dp + r + 1)*mbs]. For a short (partial) global
    batch the tail lists are shorter or empty, but every rank still gets `grad_accum_steps` entries so the
    collectives of every micro-step stay matched across ranks.
    """
    capacity = micro_batch_size * grad_accum_steps * dp_size
    if len(indices) > capacity:
        raise ValueError(
            f"{len(indices)} indices exceed micro {micro_batch_size} x GAS {grad_accum_steps} x dp {dp_size}"
        )
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} outside dp_size {dp_size}")
    out = []
    for j in range(grad_accum_steps):
        start = (j * dp_size + rank) * micro_batch_size
        out.append(list(indices[start : start + micro_batch_size]))
    return out


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its longest example: input_ids, attention_mask, labels (-100 on padding).

    An empty list gives one dummy row (a pad token, attention 1, label -100): a rank with nothing left in a
    partial window still runs forward/backward, contributing zero tokens and zero loss, so collectives and
    engine hooks stay matched across ranks.
    """
    if not examples:
        return {
            "input_ids": torch.tensor([[pad_id]], dtype=torch.long),
            "attention_mask": torch.ones(1, 1, dtype=torch.long),
            "labels": torch.full((1, 1), IGNORE_INDEX, dtype=torch.long),
        }
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e.labels, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
