"""Preference data (`train.objective` dpo / simpo / orpo): TRL's `{prompt, chosen, rejected}` records in,
`PreferencePair`s out, from every source `data.path` takes and through the tokenization cache.

    strings          [bos] + prompt, then response + [eos] (as `prompt_response`: no second eos after a
                     response ending in it); labels on the response and eos
    conversational   the tokenizer's chat template: the prompt rendered with its generation prompt, then
                     each response (its assistant messages) after it; labels on the response's assistant
                     tokens only (never on assistant turns inside the prompt)

Both sequences of a pair start with the same prompt tokens. Truncation, per sequence of `max_seq_len` (L)
tokens: when the prompt and the longer response do not fit, the prompt gives way first, cut from its start
(bos, where it has one, stays first; the end next to the response is kept), down to no less than L // 2
tokens; then each response is cut at its end to what is left (its eos may go). Both sequences keep the same
prompt tokens, so they still differ only in the response.

A pair is dropped and counted when its chosen and rejected sequences are the same tokens (once truncated:
there is nothing to prefer), or when a sequence has no label token left; a source where more than half are
identical is refused (a wrong field, not data). An empty response (or an empty assistant message in one)
follows `data.empty_responses` as in SFT: `drop` (counted; refused when more than half are), `keep` (an
empty response is eos alone), `error` (refuses the first; then an identical pair is refused too).

A record's optional `margin` (TRL's reward-model column: a finite number) rides with its pair
(`PreferencePair.margin`); `train.objective: reward` subtracts it inside the Bradley-Terry loss.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError
from zerofit.data.cache import CachedData, load_cached, save_cached, vocab_size
from zerofit.data.cache_check import checked
from zerofit.data.chat import require_chat_template, tokenize_conversation, tokenize_prompt
from zerofit.data.formats import Preference, detect_format, parse_record
from zerofit.data.pairs import PreferencePair
from zerofit.data.records import PROGRESS_EVERY, RecordSource
from zerofit.data.sft import (
    EMPTY_RESPONSE_RULES,
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

__all__ = ["ResponseTokens", "fit_pair", "load_preference_pairs", "tokenize_pair"]


@dataclass
class ResponseTokens:
    """One response's tokens after the prompt, and which of them are learned."""

    ids: list[int]
    learn: list[bool]


def _string_pair(
    tokenizer: Any, record: Preference, limit: int
) -> tuple[list[int], int, ResponseTokens, ResponseTokens]:
    """(prompt ids, leading tokens a cut keeps, chosen, rejected) of a string record; only as much text is
    tokenized as a sequence can keep (the prompt's end, the responses' start)."""
    assert (
        isinstance(record.prompt, str) and isinstance(record.chosen, str) and isinstance(record.rejected, str)
    )
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt = bos + encode_tail(tokenizer, record.prompt, limit)[0]
    sides = []
    for text in (record.chosen, record.rejected):
        ids = ending_in_eos(encode_head(tokenizer, text, limit)[0], tokenizer.eos_token_id)
        sides.append(ResponseTokens(ids, [True] * len(ids)))
    return prompt, len(bos), sides[0], sides[1]


def _conversation_pair(
    tokenizer: Any, record: Preference, limit: int, where: str
) -> tuple[list[int], int, ResponseTokens, ResponseTokens]:
    """`_string_pair` for a conversational record, through the chat template (prompt contents cut to their
    end, response contents to their start, before rendering)."""
    assert (
        isinstance(record.prompt, list)
        and isinstance(record.chosen, list)
        and isinstance(record.rejected, list)
    )
    prompt_turns = [{**m, "content": text_tail_within(tokenizer, m["content"], limit)} for m in record.prompt]
    prompt = tokenize_prompt(tokenizer, prompt_turns, where)
    sides = []
    for turns in (record.chosen, record.rejected):
        turns = [{**m, "content": text_within(tokenizer, m["content"], limit)} for m in turns]
        # No limit here: the contents are already cut, and `fit_pair` truncates by the rule above.
        ids, mask, _ = tokenize_conversation(tokenizer, prompt_turns + turns, sys.maxsize, where)
        if ids[: len(prompt)] != prompt:
            raise DataError(
                f"{where}: the chat template renders the prompt differently once a response follows (its "
                "tokens with the generation prompt are not the start of the whole conversation's), so the "
                "chosen and rejected sequences would not share one prompt. Set data.chat_template to a "
                "template whose generation prompt is where the assistant's answer starts."
            )
        sides.append(ResponseTokens(ids[len(prompt) :], mask[len(prompt) :]))
    keep_first = int(bool(prompt) and prompt[0] == tokenizer.bos_token_id)
    return prompt, keep_first, sides[0], sides[1]


def fit_pair(
    prompt: list[int], keep_first: int, chosen: ResponseTokens, rejected: ResponseTokens, max_seq_len: int
) -> tuple[list[int], ResponseTokens, ResponseTokens, bool, bool]:
    """The truncation rule (module docstring): (prompt, chosen, rejected, prompt_cut, truncated), every
    sequence prompt + response at most `max_seq_len` tokens; `keep_first` leading prompt tokens (bos) stay."""
    longest = max(len(chosen.ids), len(rejected.ids))
    room = max(max_seq_len - longest, max_seq_len // 2)
    prompt_cut = len(prompt) > room
    if prompt_cut:
        head = prompt[: min(keep_first, room)]
        prompt = head + prompt[len(prompt) - (room - len(head)) :]
    space = max_seq_len - len(prompt)
    cut = [ResponseTokens(r.ids[:space], r.learn[:space]) for r in (chosen, rejected)]
    return prompt, cut[0], cut[1], prompt_cut, prompt_cut or longest > space


def _example(prompt: list[int], response: ResponseTokens) -> Example:
    labels = [t if learn else IGNORE_INDEX for t, learn in zip(response.ids, response.learn, strict=True)]
    return Example(prompt + response.ids, [IGNORE_INDEX] * len(prompt) + labels)


def tokenize_pair(
    tokenizer: Any, record: Preference, max_seq_len: int, where: str = "record"
) -> tuple[PreferencePair, bool, bool]:
    """One record as a pair of sequences sharing the prompt tokens: (pair, prompt_cut, truncated)."""
    if record.conversational:
        parts = _conversation_pair(tokenizer, record, max_seq_len, where)
    else:
        parts = _string_pair(tokenizer, record, max_seq_len)
    prompt, chosen, rejected, prompt_cut, truncated = fit_pair(*parts, max_seq_len)
    return PreferencePair(_example(prompt, chosen), _example(prompt, rejected)), prompt_cut, truncated


def record_margin(record: dict[str, Any], where: str) -> float | None:
    """A record's `margin` column (TRL's reward-model layout) as a float; None when it has none (or null)."""
    value = record.get("margin")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DataError(
            f"{where}: 'margin' = {value!r}, and a pair's margin (how far the chosen response should out-score "
            "the rejected one in the reward model's Bradley-Terry loss, TRL's column) must be a finite number; "
            "fix the value, or remove the field (no margin)"
        )
    return float(value)


def _whole_texts(record: dict[str, Any], whole_texts: bool) -> dict[str, Any]:
    """A reward model scores texts, no prompt needed: a string record with no 'prompt' whose two texts share
    no beginning (which TRL's implicit prompt cannot split) is scored whole, its prompt empty (TRL's
    RewardTrainer tokenizes each text alone), when the objective scores `whole_texts`. Any other record, and
    any other objective, as it is."""
    chosen, rejected = record.get("chosen"), record.get("rejected")
    whole = whole_texts and "prompt" not in record and isinstance(chosen, str) and isinstance(rejected, str)
    return {**record, "prompt": ""} if whole and chosen[:1] != rejected[:1] else record


def _empty(record: Preference) -> bool:
    """Whether either response is empty or blank (conversational: has no message, or a blank one)."""
    for response in (record.chosen, record.rejected):
        if isinstance(response, str):
            if not response.strip():
                return True
        elif not response or any(not str(m["content"]).strip() for m in response):
            return True
    return False


class _PairTokenizer:
    """Turns a source's records into pairs, counting what happens (one instance per load)."""

    def __init__(
        self,
        tokenizer: Any,
        max_seq_len: int,
        fmt: str,
        key: str,
        empty_responses: str,
        objective: str | None,
        whole_texts: bool,
    ) -> None:
        self.tokenizer, self.max_seq_len, self.key = tokenizer, max_seq_len, key
        self.empty_responses, self.objective = empty_responses, objective
        self.whole_texts = whole_texts
        self.format: str | None = None if fmt == "auto" else fmt
        self.detected = fmt == "auto"
        self.pairs: list[PreferencePair] = []
        self.records: list[int] = []
        self.n_records = self.n_empty = self.n_identical = self.n_dropped = 0
        self.n_truncated = self.n_prompt_cut = 0
        self.first_empty = self.first_identical = ""

    def add(self, index: int, where: str, record: dict[str, Any], source: RecordSource) -> None:
        if self.format is None:
            self.format = detect_format(record, where, self.key)
        if self.format != "preference":
            raise self.wrong_format(source)
        parsed = parse_record("preference", _whole_texts(record, self.whole_texts), where)
        assert isinstance(parsed, Preference)
        if parsed.conversational and not self.n_records:  # before tokenizing: the fix is in the config
            require_chat_template(self.tokenizer, f"{self.key} = {source.name!r}")
        self.n_records += 1
        if _empty(parsed) and not self._keep_empty(where):
            self.n_dropped += 1
            return
        pair, prompt_cut, truncated = tokenize_pair(self.tokenizer, parsed, self.max_seq_len, where)
        if pair.chosen.input_ids == pair.rejected.input_ids:
            self._identical(where)
        elif not (has_labels(pair.chosen.labels) and has_labels(pair.rejected.labels)):
            self.n_dropped += 1
        else:
            self.n_truncated += truncated
            self.n_prompt_cut += prompt_cut
            pair.margin = record_margin(record, where)
            self.pairs.append(pair)
            self.records.append(index)

    def wrong_format(self, source: RecordSource) -> DataError:
        """The error for records of another format read for a preference objective."""
        found = (
            f"data.format=auto found {self.format!r}" if self.detected else f"data.format = {self.format!r}"
        )
        who = f"train.objective = {self.objective!r}" if self.objective else "a pairwise objective"
        return DataError(
            f"{source.describe()}: {found}, and {who} learns from preference "
            "pairs: records with 'prompt', 'chosen' and 'rejected' (TRL's layout: strings, or lists of "
            "messages). Point data.path at preference data, or set train.objective=sft to fine-tune on "
            "these records."
        )

    def _keep_empty(self, where: str) -> bool:
        """A pair with an empty response: counted; kept (True) under `keep`, refused under `error`."""
        if self.empty_responses == "error":
            raise DataError(
                f"{where}: a response is empty ('chosen' or 'rejected' holds nothing but whitespace), and "
                "data.empty_responses = 'error' refuses such records; fill it in or remove the record, or set "
                "data.empty_responses=drop to skip such pairs (counted in the plan)."
            )
        self.n_empty += 1
        self.first_empty = self.first_empty or where
        return self.empty_responses == "keep"

    def _identical(self, where: str) -> None:
        """A pair whose two sequences are the same tokens: nothing to prefer, so dropped (refused under
        `error`)."""
        if self.empty_responses == "error":
            raise DataError(
                f"{where}: 'chosen' and 'rejected' are the same tokens once tokenized and cut to "
                f"data.max_seq_len = {self.max_seq_len}, so there is nothing to prefer, and "
                "data.empty_responses = 'error' refuses such records; make the responses differ (or raise "
                "data.max_seq_len when they differ only beyond it), or set data.empty_responses=drop to skip "
                "such pairs (counted in the plan)."
            )
        self.n_identical += 1
        self.n_dropped += 1
        self.first_identical = self.first_identical or where

    def refusal(self, source: RecordSource) -> DataError | None:
        """The error for a source where more than half the pairs are identical or (under `drop`) empty."""
        if self.n_identical * 2 > self.n_records:
            return DataError(
                f"{source.name}: {self.n_identical} of {self.n_records} pairs have the same chosen and rejected "
                f"tokens (the first at {self.first_identical}) once cut to data.max_seq_len = "
                f"{self.max_seq_len}; with so few left this looks like the wrong fields rather than data. Check "
                "that 'chosen' and 'rejected' hold different responses, or raise data.max_seq_len if they differ "
                "only past it."
            )
        if self.empty_responses == "drop" and self.n_empty * 2 > self.n_records:
            return DataError(
                f"{source.name}: {self.n_empty} of {self.n_records} pairs have an empty response (the first at "
                f"{self.first_empty}); with so few left this looks like the wrong field rather than data, and "
                "data.empty_responses = 'drop' refuses a source where more than half are empty. Check the "
                "'chosen' and 'rejected' fields, fill them in, or set data.empty_responses=keep to train on them."
            )
        return None

    def result(self, source: RecordSource) -> TokenizedData[PreferencePair]:
        problem = self.refusal(source)
        if problem is not None:
            raise problem
        if not self.pairs:
            raise DataError(
                f"{source.name}: no preference pairs ({source.rows} records read, {self.n_dropped} dropped: none "
                f"left a response token within data.max_seq_len = {self.max_seq_len}); add records such as "
                '{"prompt": "...", "chosen": "...", "rejected": "..."}, or raise data.max_seq_len.'
            )
        stats = DataStats(
            n_lines=source.rows,
            n_examples=len(self.pairs),
            n_truncated=self.n_truncated,
            n_dropped=self.n_dropped,
            format="preference",
            source=source.describe(),
            detected=self.detected,
            n_empty=self.n_empty,
            empty_responses=self.empty_responses,
            n_identical=self.n_identical,
            n_prompt_cut=self.n_prompt_cut,
        )
        return TokenizedData(self.pairs, stats, self.records)


def _tokenize_source(
    source: RecordSource, state: _PairTokenizer, progress: bool
) -> TokenizedData[PreferencePair]:
    with source.tokenizing(progress) as shown:
        for index, (where, record) in enumerate(source):
            if index % PROGRESS_EVERY == 0:
                shown.update(source.consumed)
            state.add(index, where, record, source)
    return state.result(source)


def _save(entry: str, data: TokenizedData[PreferencePair], vocab: int) -> None:
    """Store the pairs as examples chosen, rejected, chosen, ... (each record listed once per sequence)."""
    examples = [e for p in data.examples for e in (p.chosen, p.rejected)]
    records = [r for r in data.records for _ in range(2)]
    meta: dict[str, Any] = {"stats": asdict(data.stats), "unit": "pairs"}
    if any(p.margin is not None for p in data.examples):
        meta["margins"] = [p.margin for p in data.examples]
    save_cached(entry, [e.input_ids for e in examples], [e.labels for e in examples], records, meta, vocab)


def _from_cache(hit: CachedData) -> TokenizedData[PreferencePair] | None:
    """The pairs of a cache entry (None for an entry that holds no pairs: then the data is tokenized)."""
    if hit.meta.get("unit") != "pairs" or len(hit.ids) % 2:
        return None
    examples = [Example(ids, labels) for ids, labels in zip(hit.ids, hit.labels, strict=True)]
    pairs = [PreferencePair(examples[i], examples[i + 1]) for i in range(0, len(examples), 2)]
    for pair, margin in zip(pairs, hit.meta.get("margins") or [], strict=False):
        pair.margin = margin
    stats = DataStats(**{**hit.meta["stats"], "from_cache": True})
    return TokenizedData(pairs, stats, hit.records[::2])


def load_preference_pairs(
    path: str | Path,
    tokenizer: Any,
    max_seq_len: int,
    *,
    format: str = "auto",
    split: str = "train",
    subset: str | None = None,
    cache: bool = False,
    progress: bool = False,
    key: str = "data.path",
    empty_responses: str = "drop",
    objective: str | None = None,
    whole_texts: bool = False,
) -> TokenizedData[PreferencePair]:
    """Read and tokenize the preference pairs `path` names (any source `load_examples` reads).

    The options are `load_examples`'; `objective` (`train.objective`) is named when the data is not
    preference pairs; `whole_texts` (a reward model's) scores a prompt-less pair as two whole texts. Returns one `PreferencePair` per kept record, the stats (`format` 'preference') and
    each pair's record (0-based, in source order: for held-out splits).
    """
    if empty_responses not in EMPTY_RESPONSE_RULES:
        raise ValueError(f"empty_responses must be one of {EMPTY_RESPONSE_RULES}, not {empty_responses!r}")
    with gc_paused():
        source = open_tokenizable(path, tokenizer, split, subset, key)
        # unit: never the entry of the same source read for SFT; pair_fields: never an entry from before the
        # `margin` column rode with the pairs; a reward model's own entry (it reads whole texts, `_whole_texts`)
        whole = {"whole_texts": True} if whole_texts else {}
        entry = cache_entry(source, tokenizer, cache, format=format, max_seq_len=max_seq_len,
                            empty_responses=empty_responses, unit="pairs", pair_fields="margin",
                            **whole)  # fmt: skip
        hit = load_cached(entry, vocab_size(tokenizer)) if entry is not None else None
        data = _from_cache(hit) if hit is not None else None

        def again(picked: list[int]) -> tuple[list[PreferencePair], list[int]]:
            state = _PairTokenizer(
                tokenizer, max_seq_len, format, key, empty_responses, objective, whole_texts
            )
            for index, where, record in source.records_at(picked):
                state.add(index, where, record, source)
            return state.pairs, state.records

        if (
            data is not None
            and entry is not None
            and checked(entry, data.examples, data.records, again, source.name)
        ):
            return data
        state = _PairTokenizer(tokenizer, max_seq_len, format, key, empty_responses, objective, whole_texts)
        data = _tokenize_source(source, state, progress)
        if entry is not None:
            _save(entry, data, vocab_size(tokenizer))
        return data
