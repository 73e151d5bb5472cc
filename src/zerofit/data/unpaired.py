"""Unpaired feedback (`train.objective: kto`): TRL's `{prompt, completion, label}` records in, `UnpairedExample`s
out, and the micro-batches of a global batch with each example's mismatched (KL) sequence.

    strings          [bos] + prompt, then completion + [eos] (as `prompt_response`: no second eos after a
                     completion ending in it); labels on the completion and eos
    conversational   'prompt' and 'completion' lists of messages ('completion' the assistant's only), through
                     the tokenizer's chat template as a preference pair's (`zerofit.data.preference`): the
                     prompt with its generation prompt, labels on the completion's assistant tokens
    label            true: a desirable completion; false: an undesirable one (JSON booleans only)

Truncation is a preference pair's with one response (`fit_pair`): the prompt gives way first, from its start,
to no less than max_seq_len // 2 tokens, then the completion is cut at its end.

The KL sequences. KTO's reference point z0 is estimated from mismatched (prompt, completion) pairs: in a
global batch of n examples in the sampler's order, example k is also scored with the completion of example
k - 1 (example 0 with that of example n - 1), TRL's rotation by one, but over the global batch rather than
one device's micro-batch. So the pairing depends on the global batch alone, never on how it is split into
micro-batches and ranks (`kto_micro_batches`). A mismatched sequence is prompt_k + completion_(k-1), cut at
its end to max_seq_len (TRL's collator cuts from the right too). A global batch of one example pairs it with
itself (as TRL's batch of one does).

Under a token budget (`batch.tokens_per_micro_batch`) the examples are packed as SFT's are (segments of rows
of max_seq_len tokens, position ids restarting per segment: `zerofit.data.packing`), numbered by
`sequence_ids` in the micro-batch's example order; their mismatched sequences are packed into rows of their
own (`kl_*`, the same numbering). The pairing is the global batch's either way.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import DataError
from zerofit.data.batches import collate, split_global_batch
from zerofit.data.cache import CachedData, load_cached, save_cached, vocab_size
from zerofit.data.cache_check import checked
from zerofit.data.chat import require_chat_template, tokenize_conversation, tokenize_prompt
from zerofit.data.formats import _messages
from zerofit.data.packing import Segment, collate_packed, pack_rows, packed_unit_micro_batches, units_of
from zerofit.data.preference import ResponseTokens, fit_pair
from zerofit.data.records import PROGRESS_EVERY, RecordSource
from zerofit.data.sft import (
    DataStats,
    Example,
    TokenizedData,
    cache_entry,
    gc_paused,
    has_labels,
    open_tokenizable,
)
from zerofit.data.tokenize import encode_head, encode_tail, ending_in_eos, text_tail_within, text_within
from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = [
    "UnpairedExample",
    "collate_unpaired",
    "kto_micro_batches",
    "load_unpaired",
    "mismatched",
    "require_both_labels",
]

LAYOUT = (
    "KTO learns from TRL's unpaired layout: records with 'prompt', 'completion' and 'label' (true for a "
    "desirable completion, false for an undesirable one; prompt and completion both strings, or both lists "
    'of messages), e.g. {"prompt": "2+2=", "completion": "4", "label": true}'
)


@dataclass
class UnpairedExample:
    """One record: prompt + completion tokens (`example`, labels on the completion), where the completion
    starts, the label, and the max_seq_len it was cut to (a mismatched sequence is cut to it too)."""

    example: Example
    prompt_len: int
    desirable: bool
    max_seq_len: int

    @property
    def input_ids(self) -> list[int]:
        """The sequence's tokens (for token accounting)."""
        return self.example.input_ids

    @property
    def labels(self) -> list[int]:
        return self.example.labels


def mismatched(prompt_of: UnpairedExample, completion_of: UnpairedExample) -> Example:
    """prompt_of's prompt + completion_of's completion (labels on the completion), cut to max_seq_len."""
    a, b = prompt_of, completion_of
    ids = a.input_ids[: a.prompt_len] + b.input_ids[b.prompt_len :]
    labels = [IGNORE_INDEX] * a.prompt_len + b.labels[b.prompt_len :]
    return Example(ids[: a.max_seq_len], labels[: a.max_seq_len])


def collate_unpaired(
    units: list[UnpairedExample], partners: list[UnpairedExample], pad_id: int
) -> dict[str, torch.Tensor]:
    """A micro-batch: `collate`'s rows of the examples, `kl_input_ids` / `kl_attention_mask` / `kl_labels`
    of their mismatched sequences (each example's prompt with its partner's completion), `desirable` (bool
    per row) and `examples` (m). An empty list gives `collate([])`'s dummy row and `examples` = 0."""
    main = collate([u.example for u in units], pad_id)
    kl = collate([mismatched(u, p) for u, p in zip(units, partners, strict=True)], pad_id)
    return {
        **main,
        **{f"kl_{k}": v for k, v in kl.items()},
        "desirable": torch.tensor([u.desirable for u in units], dtype=torch.bool),
        "examples": torch.tensor(len(units)),
    }


def collate_packed_unpaired(
    rows: list[list[Segment]], units: list[UnpairedExample], partners: list[UnpairedExample], pad_id: int
) -> dict[str, torch.Tensor]:
    """A packed micro-batch (`rows` of (position, 0) segments into `units` / `partners`, by position in the
    global batch): `collate_packed`'s tensors with `sequence_ids` (the micro-batch's k-th example is k), its
    mismatched sequences packed into rows of their own (`kl_*`, numbered alike), `desirable` and `examples`
    in the same example order. No rows: the dummy rows and `examples` = 0."""
    order = units_of(rows)
    at = {k: j for j, k in enumerate(order)}
    main = collate_packed(
        [[units[k].example for k, _ in row] for row in rows],
        pad_id,
        [[at[k] for k, _ in row] for row in rows],
    )
    kl = [mismatched(units[k], partners[k]) for k in order]
    capacity = max((u.max_seq_len for u in units), default=1)
    kl_rows = pack_rows(list(range(len(kl))), {j: len(e.input_ids) for j, e in enumerate(kl)}, capacity)
    kl_batch = collate_packed([[kl[j] for j in row] for row in kl_rows], pad_id, kl_rows)
    return {
        **main,
        **{f"kl_{k}": v for k, v in kl_batch.items()},
        "desirable": torch.tensor([units[k].desirable for k in order], dtype=torch.bool),
        "examples": torch.tensor(len(order)),
    }


def kto_micro_batches(
    units: list[UnpairedExample],
    indices: list[int],
    micro_batch_size: int,
    grad_accum_steps: int,
    dp_size: int,
    rank: int,
    pad_id: int,
    row_tokens: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the global batch `indices` (the sampler's order), each example with
    its partner over the whole global batch: the one before it, the first with the last (module docstring).
    With `row_tokens` (data.max_seq_len) the
    examples are packed, micro_batch_size rows of row_tokens per micro-batch."""
    micro, accum, dp = micro_batch_size, grad_accum_steps, dp_size
    n = len(indices)
    batch = [units[i] for i in indices]
    partners = [units[indices[(k - 1) % n]] for k in range(n)]
    if row_tokens is not None:
        lengths = {k: (len(batch[k].input_ids),) for k in range(n)}
        packed = packed_unit_micro_batches(list(range(n)), lengths, micro, row_tokens, dp, rank)
        return [collate_packed_unpaired(rows, batch, partners, pad_id) for rows in packed]
    positions = split_global_batch(list(range(n)), micro, accum, dp, rank)
    return [collate_unpaired([batch[k] for k in ks], [partners[k] for k in ks], pad_id) for ks in positions]


def _parse(record: dict[str, Any], where: str) -> tuple[str | list[dict[str, Any]], Any, bool]:
    """(prompt, completion, label) of a record, or the paragraph that says what is wrong with it."""
    missing = [k for k in ("prompt", "completion", "label") if k not in record]
    if missing:
        paired = (
            " (it looks like a preference pair: use train.objective=dpo for pairs)"
            if "chosen" in record
            else ""
        )
        raise DataError(f"{where}: missing {', '.join(map(repr, missing))}{paired}. {LAYOUT}.")
    label = record["label"]
    if not isinstance(label, bool):
        raise DataError(
            f"{where}: 'label' is {label!r} ({type(label).__name__}), and KTO's label is a JSON boolean: true "
            "for a desirable completion, false for an undesirable one. Convert the labels in the data file "
            '(e.g. "label": true, not "yes" or 1).'
        )
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion, label
    if isinstance(prompt, list) and isinstance(completion, list):
        turns = _messages(completion, "completion", where)
        if any(m["role"] != "assistant" for m in turns):
            raise DataError(
                f"{where}: 'completion' holds messages of roles {', '.join(repr(m['role']) for m in turns)}; in "
                "TRL's conversational layout it holds only the assistant's answer (the rest belongs in 'prompt')."
            )
        return _messages(prompt, "prompt", where), turns, label
    raise DataError(
        f"{where}: 'prompt' is a {type(prompt).__name__} and 'completion' a {type(completion).__name__}; both "
        f"must be strings or both lists of messages. {LAYOUT}."
    )


def tokenize_unpaired(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    completion: Any,
    label: bool,
    max_seq_len: int,
    where: str,
) -> tuple[UnpairedExample, bool]:
    """One record as an `UnpairedExample` (the module docstring's rule), and whether it was cut."""
    if isinstance(prompt, str):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        prompt_ids = bos + encode_tail(tokenizer, prompt, max_seq_len)[0]
        ids = ending_in_eos(encode_head(tokenizer, completion, max_seq_len)[0], tokenizer.eos_token_id)
        response, keep_first = ResponseTokens(ids, [True] * len(ids)), len(bos)
    else:
        turns = [{**m, "content": text_tail_within(tokenizer, m["content"], max_seq_len)} for m in prompt]
        prompt_ids = tokenize_prompt(tokenizer, turns, where)
        answer = [{**m, "content": text_within(tokenizer, m["content"], max_seq_len)} for m in completion]
        ids, mask, _ = tokenize_conversation(tokenizer, turns + answer, sys.maxsize, where)
        if ids[: len(prompt_ids)] != prompt_ids:
            raise DataError(
                f"{where}: the chat template renders the prompt differently once a completion follows, so the "
                "completion cannot be told from the prompt. Set data.chat_template to a template whose "
                "generation prompt is where the assistant's answer starts."
            )
        response = ResponseTokens(ids[len(prompt_ids) :], mask[len(prompt_ids) :])
        keep_first = int(bool(prompt_ids) and prompt_ids[0] == tokenizer.bos_token_id)
    cut_prompt, cut, _, _, truncated = fit_pair(prompt_ids, keep_first, response, response, max_seq_len)
    labels = [t if learn else IGNORE_INDEX for t, learn in zip(cut.ids, cut.learn, strict=True)]
    example = Example(cut_prompt + cut.ids, [IGNORE_INDEX] * len(cut_prompt) + labels)
    return UnpairedExample(example, len(cut_prompt), label, max_seq_len), truncated


@dataclass
class _Counts:
    """What loading a source did: kept examples, their records, dropped and cut ones, the labels seen."""

    kept: list[UnpairedExample]
    records: list[int]
    n_records: int = 0
    n_dropped: int = 0
    n_truncated: int = 0
    n_desirable: int = 0


def _add(
    counts: _Counts, tokenizer: Any, max_seq_len: int, index: int, where: str, record: Any, name: str
) -> None:
    """Tokenize record `index` of the source `name` into `counts`."""
    prompt, completion, label = _parse(record, where)
    if not isinstance(prompt, str) and not counts.n_records:
        require_chat_template(tokenizer, f"{name!r}")
    counts.n_records += 1
    unit, truncated = tokenize_unpaired(tokenizer, prompt, completion, label, max_seq_len, where)
    if not has_labels(unit.labels):  # an empty completion, or a prompt that left it no room
        counts.n_dropped += 1
        return
    counts.kept.append(unit)
    counts.records.append(index)
    counts.n_truncated += truncated
    counts.n_desirable += label


def _tokenize_source(source: RecordSource, tokenizer: Any, max_seq_len: int, progress: bool) -> _Counts:
    counts = _Counts([], [])
    with source.tokenizing(progress) as shown:
        for index, (where, record) in enumerate(source):
            if index % PROGRESS_EVERY == 0:
                shown.update(source.consumed)
            _add(counts, tokenizer, max_seq_len, index, where, record, source.name)
    return counts


def _result(source: RecordSource, counts: _Counts, max_seq_len: int) -> TokenizedData[UnpairedExample]:
    if not counts.kept:
        raise DataError(
            f"{source.name}: no examples ({source.rows} records read, {counts.n_dropped} dropped: none left a "
            f"completion token within data.max_seq_len = {max_seq_len}). {LAYOUT}; or raise data.max_seq_len."
        )
    stats = DataStats(
        n_lines=source.rows,
        n_examples=len(counts.kept),
        n_truncated=counts.n_truncated,
        n_dropped=counts.n_dropped,
        format="unpaired",
        source=source.describe(),
        detected=True,
    )
    return TokenizedData(counts.kept, stats, counts.records)


def require_both_labels(
    data: TokenizedData[UnpairedExample], key: str, check: bool = True
) -> TokenizedData[UnpairedExample]:
    """`data`, unless `check` (training data) and its examples all carry the same label: KTO would then learn
    only one side of its loss, which is SFT-like at best and usually a label column read wrong."""
    desirable = sum(u.desirable for u in data.examples)
    if check and desirable in (0, len(data.examples)):
        which = "true (desirable)" if desirable else "false (undesirable)"
        raise DataError(
            f"{key}: all {len(data.examples)} examples have label {which}, and KTO learns from both kinds: it "
            "raises the desirable completions' reward above the KL reference point and lowers the undesirable "
            "ones' below it. Check the 'label' field (true / false per record), add examples of the other "
            "label, or use train.objective=sft to learn from good completions alone."
        )
    return data


def _save(entry: str, data: TokenizedData[UnpairedExample], vocab: int) -> None:
    units = data.examples
    meta = {
        "stats": asdict(data.stats),
        "unit": "unpaired",
        "desirable": [u.desirable for u in units],
        "prompt_len": [u.prompt_len for u in units],
    }
    save_cached(entry, [u.input_ids for u in units], [u.labels for u in units], data.records, meta, vocab)


def _from_cache(hit: CachedData, max_seq_len: int) -> TokenizedData[UnpairedExample] | None:
    if hit.meta.get("unit") != "unpaired" or len(hit.meta.get("desirable", ())) != len(hit.ids):
        return None
    units = [
        UnpairedExample(Example(ids, labels), int(n), bool(d), max_seq_len)
        for ids, labels, n, d in zip(
            hit.ids, hit.labels, hit.meta["prompt_len"], hit.meta["desirable"], strict=True
        )
    ]
    return TokenizedData(units, DataStats(**{**hit.meta["stats"], "from_cache": True}), hit.records)


def load_unpaired(
    path: str | Path,
    tokenizer: Any,
    max_seq_len: int,
    *,
    split: str = "train",
    subset: str | None = None,
    cache: bool = False,
    progress: bool = False,
    key: str = "data.path",
) -> TokenizedData[UnpairedExample]:
    """Read and tokenize the unpaired examples `path` names (any source `load_examples` reads), through the
    tokenization cache: one `UnpairedExample` per kept record, the stats, each example's record."""
    with gc_paused():
        source = open_tokenizable(path, tokenizer, split, subset, key)
        entry = cache_entry(
            source, tokenizer, cache, format="unpaired", max_seq_len=max_seq_len, unit="unpaired"
        )
        hit = load_cached(entry, vocab_size(tokenizer)) if entry is not None else None
        data = _from_cache(hit, max_seq_len) if hit is not None else None

        def again(picked: list[int]) -> tuple[list[UnpairedExample], list[int]]:
            counts = _Counts([], [])
            for index, where, record in source.records_at(picked):
                _add(counts, tokenizer, max_seq_len, index, where, record, source.name)
            return counts.kept, counts.records

        if (
            data is not None
            and entry is not None
            and checked(entry, data.examples, data.records, again, source.name)
        ):
            return data
        data = _result(source, _tokenize_source(source, tokenizer, max_seq_len, progress), max_seq_len)
        if entry is not None:
            _save(entry, data, vocab_size(tokenizer))
        return data
