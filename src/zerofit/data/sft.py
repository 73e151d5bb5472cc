"""Supervised fine-tuning data: read records from any source, tell their format, tokenize, mask, truncate.

    open_source (records.py) -> detect_format / parse_record (formats.py) -> token ids:
      prompt_response, alpaca   [bos] + prompt + response + [eos]; labels on the response and eos
      messages                  the tokenizer's chat template (chat.py); labels on every assistant turn
      text                      [bos] + text + [eos] cut into max_seq_len chunks (overlapping by one token,
                                so every token after the first is learned once); labels on every token
      (a response or text that already ends in the eos token gets no second one: `ending_in_eos`, TRL's rule)
    -> `Example`s, `DataStats` (what loading did), and the record each example came from (for held-out
       evaluation splits, `holdout.py`)

A sequence longer than `max_seq_len` is truncated (a text document is cut into several examples instead);
an example left with no label token is dropped and counted. A record whose response is empty (or blank; for
`messages`: with an empty assistant turn) would teach only eos, "answer with nothing": `data.empty_responses`
says what happens to it (`EMPTY_RESPONSE_RULES`): `drop` (default) drops and counts it, and refuses a
source where more than half the records are such (a wrong field, not data); `keep` trains on it, counted;
`error` refuses the first one. Text is never tokenized beyond what a
sequence can keep (`tokenize.py`). With `cache=True` the result is stored and reused (`cache.py`). Every
problem raises `DataError` naming the source and the record.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, get_args

from zerofit.config.schema import EmptyResponses
from zerofit.core.errors import DataError
from zerofit.data.cache import (
    CachedData,
    cache_key,
    load_cached,
    save_cached,
    tokenizer_fingerprint,
    vocab_size,
)
from zerofit.data.cache_check import checked
from zerofit.data.chat import require_chat_template, tokenize_conversation
from zerofit.data.formats import Conversation, Document, PromptResponse, detect_format, parse_record
from zerofit.data.records import PROGRESS_EVERY, RecordSource, open_source
from zerofit.data.tokenize import encode_document, encode_head, ending_in_eos
from zerofit.data.truncation import LENGTH_PROBE, length_keeping_whole
from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = ["DataStats", "Example", "TokenizedData", "load_examples", "load_sft_dataset", "tokenize_example"]

EMPTY_RESPONSE_RULES: tuple[str, ...] = get_args(EmptyResponses)  # data.empty_responses
# The field that holds what is learned, per format, for messages about empty responses.
_RESPONSE_FIELD = {
    "prompt_response": "'response'",
    "alpaca": "'output'",
    "messages": "the assistant messages' content",
}


@dataclass
class Example:
    """One tokenized training sequence; `labels` is IGNORE_INDEX where the loss skips (not shifted: HF-style)."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class DataStats:
    """What loading did to the source.

    `n_lines`: records read (for a JSONL file: lines, blank ones included); `n_truncated`: examples cut to
    max_seq_len; `n_dropped`: records with nothing left to learn, or dropped for an empty response;
    `n_split`: text documents longer than max_seq_len, cut into several examples; `detected`: the format
    came from `data.format=auto`; `n_empty`: records with an empty response, dropped (among `n_dropped`)
    or kept as `empty_responses` (the `data.empty_responses` rule) says. Preference pairs
    (`preference.py`) also count `n_identical`: pairs whose chosen and rejected sequence are the same
    tokens once truncated, dropped (among `n_dropped`); and `n_prompt_cut`: pairs whose prompt lost its
    start to fit (among `n_truncated`, which counts pairs with either sequence cut). `whole_len`: the
    data.max_seq_len that keeps 95% of the examples whole (`zerofit.data.truncation`; more than
    `LENGTH_PROBE` x max_seq_len reads as one past that; 0: not measured, pairs and older caches).
    """

    n_lines: int
    n_examples: int
    n_truncated: int
    n_dropped: int
    format: str = "prompt_response"
    source: str = ""
    n_split: int = 0
    detected: bool = False
    from_cache: bool = False
    n_empty: int = 0
    empty_responses: str = "drop"
    n_identical: int = 0
    n_prompt_cut: int = 0
    whole_len: int = 0
    n_missing_images: int = 0  # vision data: records dropped for an unreadable image (`data.vision`)


Unit = TypeVar("Unit")  # what one source record becomes: an `Example` (SFT) or a `PreferencePair`


@dataclass
class TokenizedData(Generic[Unit]):
    """Examples (SFT: `TokenizedData[Example]`; preference objectives: `TokenizedData[PreferencePair]`, one
    pair per record), what loading did, and the record (0-based, in source order) each came from."""

    examples: list[Unit]
    stats: DataStats
    records: list[int] = field(default_factory=list)


def has_labels(labels: list[int]) -> bool:
    # Position 0 predicts nothing (`count_label_tokens`), so a label there alone teaches nothing.
    return any(label != IGNORE_INDEX for label in labels[1:])


def _prompt_response(
    tokenizer: Any, prompt: str, response: str, max_seq_len: int
) -> tuple[Example, bool, int, bool]:
    """`tokenize_example`, plus whether the prompt was only tokenized in part (its length is then a floor)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt_head, prompt_cut = encode_head(tokenizer, prompt, max_seq_len)
    prompt_ids = bos + prompt_head
    response_ids = ending_in_eos(encode_head(tokenizer, response, max_seq_len)[0], tokenizer.eos_token_id)
    input_ids = prompt_ids + response_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
    truncated = len(input_ids) > max_seq_len
    return Example(input_ids[:max_seq_len], labels[:max_seq_len]), truncated, len(prompt_ids), prompt_cut


def tokenize_example(
    prompt: str, response: str, tokenizer: Any, max_seq_len: int
) -> tuple[Example, bool, int]:
    """Tokenize one pair as [bos] + prompt + response + [eos], truncated to `max_seq_len` (a response that
    already ends in the eos token keeps that one: `ending_in_eos`).

    Returns (example, was_truncated, prompt_length_with_bos). Labels are IGNORE_INDEX on bos and prompt, the
    token ids on response and eos; a tokenizer without a bos token simply gets none. A prompt or response
    far longer than `max_seq_len` is only tokenized as far as the sequence reaches (the prompt length is then
    that far).
    """
    example, truncated, prompt_len, _ = _prompt_response(tokenizer, prompt, response, max_seq_len)
    return example, truncated, prompt_len


def document_chunks(tokenizer: Any, text: str, max_seq_len: int) -> list[list[int]]:
    """[bos] + text + [eos] (no second eos after a text ending in it) cut into sequences of at most
    `max_seq_len` tokens.

    Each chunk starts with the last token of the one before: position 0 predicts nothing, so with this
    one-token overlap every token after the first is predicted exactly once, eos included.
    """
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    stride = max(max_seq_len - 1, 1)
    chunks: list[list[int]] = []

    def cut(pending: list[int], final: bool) -> list[int]:
        # Emit whole chunks while more than a chunk is pending (at the end: while any tokens are).
        start = 0
        while len(pending) - start > max_seq_len:
            chunks.append(pending[start : start + max_seq_len])
            start += stride
        if final and len(pending) - start >= 2:
            chunks.append(pending[start:])
        return pending[start:]

    pending = list(bos)
    for piece in encode_document(tokenizer, text):
        pending = cut(pending + piece, final=False)
    cut(ending_in_eos(pending, tokenizer.eos_token_id), final=True)
    return chunks


class _Tokenizer:
    """Turns a source's records into examples, counting what happens (one instance per load)."""

    def __init__(
        self,
        tokenizer: Any,
        max_seq_len: int,
        fmt: str,
        key: str,
        empty_responses: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tokenizer, self.max_seq_len, self.key = tokenizer, max_seq_len, key
        self.tools = tools  # `data.tools_file`: the tools of a conversation without its own
        self.empty_responses = empty_responses
        self.n_empty, self.n_records = 0, 0
        self.first_empty = ""  # where the first record with an empty response is
        self.format: str | None = None if fmt == "auto" else fmt
        self.detected = fmt == "auto"
        self.examples: list[Example] = []
        self.records: list[int] = []
        self.n_truncated = self.n_dropped = self.n_split = 0
        self.lengths: list[int] = []  # each kept example's length before the cut (`_full_length`)
        self.longest_prompt = 0
        self.prompt_cut = False  # some prompt was too long to tokenize whole: longest_prompt is a floor

    def add(self, index: int, where: str, record: dict[str, Any], source: RecordSource) -> None:
        if self.format is None:
            self.format = detect_format(record, where, self.key)
        if self.format == "preference":
            raise wrong_objective(source, self.detected)
        if index == 0 and self.format == "messages":  # before tokenizing anything: the fix is in the config
            require_chat_template(self.tokenizer, f"{self.key} = {source.name!r}")
        parsed = parse_record(self.format, record, where)
        self.n_records += 1
        if _empty_response(parsed) and not self._keep_empty(where):
            self.n_dropped += 1
            return
        if isinstance(parsed, PromptResponse):
            example, truncated, prompt_len, prompt_cut = _prompt_response(
                self.tokenizer, parsed.prompt, parsed.response, self.max_seq_len
            )
            self.longest_prompt = max(self.longest_prompt, prompt_len)
            self.prompt_cut |= prompt_cut
            self._keep(index, [example], truncated, self._full_length(parsed, where) if truncated else None)
        elif isinstance(parsed, Conversation):
            ids, mask, truncated = tokenize_conversation(
                self.tokenizer, parsed.messages, self.max_seq_len, where, parsed.tools or self.tools
            )
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
            full = self._full_length(parsed, where) if truncated else None
            self._keep(index, [Example(ids, labels)], truncated, full)
        elif isinstance(parsed, Document):
            chunks = document_chunks(self.tokenizer, parsed.text, self.max_seq_len) if parsed.text else []
            self.n_split += len(chunks) > 1
            # Every token is a label: one list serves as both (the loop never writes into either).
            self._keep(index, [Example(c, c) for c in chunks], False)

    def _keep_empty(self, where: str) -> bool:
        """A record with an empty response: counted; kept (True) under `keep`, refused under `error`."""
        if self.empty_responses == "error":
            raise DataError(
                f"{where}: the response is empty ({_RESPONSE_FIELD.get(self.format or '', 'the response')} "
                "holds nothing but whitespace), and data.empty_responses = 'error' refuses such records: a model "
                "trained on them learns to answer with nothing; fill it in or remove the record, or set "
                "data.empty_responses=drop to skip such records (counted in the plan)."
            )
        self.n_empty += 1
        self.first_empty = self.first_empty or where
        return self.empty_responses == "keep"

    def mostly_empty(self, source: RecordSource) -> DataError | None:
        """Under `drop`: the error for a source where more than half the records have an empty response."""
        if self.empty_responses != "drop" or self.n_empty * 2 <= self.n_records:
            return None
        field = _RESPONSE_FIELD.get(self.format or "", "the response field")
        return DataError(
            f"{source.name}: {self.n_empty} of {self.n_records} records have an empty response (the first at "
            f"{self.first_empty}); with so few left this looks like the wrong field rather than data, and "
            f"data.empty_responses = 'drop' refuses a source where more than half are empty. Check that the "
            f"responses are in {field} (data.format = {self.format!r}), fill them in, or set "
            "data.empty_responses=keep to train on them as they are (they teach the model to answer with only eos)."
        )

    def _full_length(self, parsed: PromptResponse | Conversation, where: str) -> int:
        """A cut example's length before the cut, measured up to `LENGTH_PROBE` x max_seq_len tokens
        (one past that when longer): only cut examples pay for this second, longer tokenization."""
        cap = LENGTH_PROBE * self.max_seq_len
        if isinstance(parsed, Conversation):
            tools = parsed.tools or self.tools
            ids, _, cut = tokenize_conversation(self.tokenizer, parsed.messages, cap, where, tools)
            return cap + 1 if cut else len(ids)
        prompt, prompt_cut = encode_head(self.tokenizer, parsed.prompt, cap)
        response, response_cut = encode_head(self.tokenizer, parsed.response, cap)
        bos = int(self.tokenizer.bos_token_id is not None)
        total = bos + len(prompt) + len(response) + 1  # + eos
        return cap + 1 if prompt_cut or response_cut or total > cap else total

    def _keep(
        self, index: int, examples: list[Example], truncated: bool, full_length: int | None = None
    ) -> None:
        kept = [e for e in examples if has_labels(e.labels)]
        if not kept:
            self.n_dropped += 1
            return
        self.lengths += [full_length or len(e.input_ids) for e in kept]
        self.n_truncated += truncated
        self.examples.extend(kept)
        self.records.extend([index] * len(kept))

    def nothing_left(self, source: RecordSource) -> DataError:
        """The error for a source that gave no example, saying why."""
        what = source.name
        if self.n_dropped == 0:
            return DataError(
                f"{what}: no examples ({source.kind} with {source.rows} records or lines, none with data); add records "
                'such as {"prompt": "...", "response": "..."} or {"messages": [...]}.'
            )
        n, limit = self.n_dropped, self.max_seq_len
        if self.format in ("prompt_response", "alpaca"):
            if self.prompt_cut:
                longest = f"the longest prompt has more than {limit} tokens"
                fix = "shorten the prompts or raise data.max_seq_len"
            else:
                longest = f"the longest prompt is {self.longest_prompt} tokens including bos"
                fix = f"set data.max_seq_len to at least {self.longest_prompt + 2} (prompt + one response token + eos)"
            return DataError(
                f"{what}: all {n} examples were dropped because data.max_seq_len = {limit} leaves no room for "
                f"any response token ({longest}); {fix}."
            )
        if self.format == "messages":
            return DataError(
                f"{what}: all {n} conversations were dropped: none has an assistant turn within the first "
                f"data.max_seq_len = {limit} tokens (or any assistant message at all); raise data.max_seq_len, "
                "shorten the system and user turns, or check the roles ('assistant' / ShareGPT 'gpt')."
            )
        return DataError(f"{what}: all {n} texts are empty; put the documents under the key 'text'.")

    def result(self, source: RecordSource) -> TokenizedData[Example]:
        problem = self.mostly_empty(source)
        if problem is not None:
            raise problem
        if not self.examples:
            raise self.nothing_left(source)
        stats = DataStats(
            n_lines=source.rows,
            n_examples=len(self.examples),
            n_truncated=self.n_truncated,
            n_dropped=self.n_dropped,
            format=self.format or "auto",
            source=source.describe(),
            n_split=self.n_split,
            detected=self.detected,
            n_empty=self.n_empty,
            empty_responses=self.empty_responses,
            whole_len=length_keeping_whole(self.lengths),
        )
        return TokenizedData(self.examples, stats, self.records)


def wrong_objective(source: RecordSource, detected: bool) -> DataError:
    """The error for preference pairs read for supervised fine-tuning (`train.objective: sft`)."""
    found = "data.format=auto found" if detected else "data.format ="
    return DataError(
        f"{source.describe()} holds preference pairs ({found} 'preference': prompt, chosen and rejected), "
        "and train.objective = 'sft' learns from one response per record, so the pairs cannot be learned as "
        "they are; set train.objective=dpo (or simpo / orpo) to tune on the preferences, or point data.path "
        "at prompt/response or messages data."
    )


def _empty_response(parsed: PromptResponse | Conversation | Document) -> bool:
    """Whether the record's response is empty or blank (for a conversation: any assistant turn's)."""
    if isinstance(parsed, PromptResponse):
        return not parsed.response.strip()
    if isinstance(parsed, Conversation):
        return any(
            m["role"] == "assistant" and not str(m["content"]).strip() and not m.get("tool_calls")
            for m in parsed.messages
        )  # a tool call is a response, its content often empty
    return False  # a text document: an empty one has no tokens and is dropped as such


def _tokenize_source(
    source: RecordSource,
    tokenizer: Any,
    max_seq_len: int,
    fmt: str,
    key: str,
    progress: bool,
    empty_responses: str = "drop",
    tools: list[dict[str, Any]] | None = None,
) -> TokenizedData[Example]:
    state = _Tokenizer(tokenizer, max_seq_len, fmt, key, empty_responses, tools)
    with source.tokenizing(progress) as shown:
        for index, (where, record) in enumerate(source):
            if index % PROGRESS_EVERY == 0:
                shown.update(source.consumed)
            state.add(index, where, record, source)
    return state.result(source)


def _from_cache(hit: CachedData) -> TokenizedData[Example]:
    examples = [Example(ids, labels) for ids, labels in zip(hit.ids, hit.labels, strict=True)]
    stats = DataStats(**{**hit.meta["stats"], "from_cache": True})
    return TokenizedData(examples, stats, hit.records)


def load_examples(
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
    tools: list[dict[str, Any]] | None = None,
) -> TokenizedData[Example]:
    """Read and tokenize the data `path` names (a file, a save_to_disk folder or a hub dataset id).

    `format`: a `data.format` value (`auto` detects it from the first record). `split` / `subset`: for hub
    datasets and saved DatasetDicts. `cache`: reuse / store the result in the tokenization cache.
    `progress`: show progress (rank 0). `key`: the config key that named `path`, for messages.
    `empty_responses`: the `data.empty_responses` rule for records with an empty response.
    `tools`: the tools of every conversation without its own (`data.tools_file`).
    """
    if empty_responses not in EMPTY_RESPONSE_RULES:
        raise ValueError(f"empty_responses must be one of {EMPTY_RESPONSE_RULES}, not {empty_responses!r}")
    with gc_paused():
        return _load(
            path, tokenizer, max_seq_len, format, split, subset, cache, progress, key, empty_responses, tools
        )


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while the examples are built: it would scan the growing heap of example
    lists again and again (two thirds of a 100k-example cache load); they hold no cycles to collect."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def open_tokenizable(
    path: str | Path, tokenizer: Any, split: str, subset: str | None, key: str
) -> RecordSource:
    """The record source `path` names (`key`: the config key that named it), refused when `tokenizer`
    cannot terminate a sequence (no eos token). Shared by the SFT and the preference loaders."""
    source = open_source(path, split=split, subset=subset, key=key)
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"{source.describe()}: the tokenizer has no eos token, so sequences cannot be terminated; use a "
            "model whose tokenizer defines eos_token."
        )
    return source


def cache_entry(source: RecordSource, tokenizer: Any, cache: bool, **parts: Any) -> str | None:
    """The tokenization-cache key of `source` read with `tokenizer` and `parts` (format, max_seq_len, the
    rules that decide which records are kept, ...), or None without caching or a source fingerprint."""
    fingerprint = source.fingerprint() if cache else None
    if fingerprint is None:
        return None
    return cache_key(source=fingerprint, tokenizer=tokenizer_fingerprint(tokenizer), **parts)


def _load(
    path: str | Path,
    tokenizer: Any,
    max_seq_len: int,
    format: str,
    split: str,
    subset: str | None,
    cache: bool,
    progress: bool,
    key: str,
    empty_responses: str,
    tools: list[dict[str, Any]] | None = None,
) -> TokenizedData[Example]:
    source = open_tokenizable(path, tokenizer, split, subset, key)
    entry = cache_entry(source, tokenizer, cache, format=format, max_seq_len=max_seq_len,
                        empty_responses=empty_responses, **({"tools": tools} if tools else {}))  # fmt: skip
    hit = load_cached(entry, vocab_size(tokenizer)) if entry is not None else None
    if hit is not None:
        cached = _from_cache(hit)

        def again(picked: list[int]) -> tuple[list[Example], list[int]]:
            state = _Tokenizer(tokenizer, max_seq_len, format, key, empty_responses, tools)
            for index, where, record in source.records_at(picked):
                state.add(index, where, record, source)
            return state.examples, state.records

        assert entry is not None
        if checked(entry, cached.examples, cached.records, again, source.name):
            return cached
    data = _tokenize_source(source, tokenizer, max_seq_len, format, key, progress, empty_responses, tools)
    if entry is not None:
        ids = [e.input_ids for e in data.examples]
        labels = [e.labels for e in data.examples]
        save_cached(entry, ids, labels, data.records, {"stats": asdict(data.stats)}, vocab_size(tokenizer))
    return data


def load_sft_dataset(
    path: str | Path, tokenizer: Any, max_seq_len: int, **options: Any
) -> tuple[list[Example], DataStats]:
    """`load_examples` as (examples, stats); `options` as there (format, split, subset, cache, ...)."""
    data = load_examples(path, tokenizer, max_seq_len, **options)
    return data.examples, data.stats
