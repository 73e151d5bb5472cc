"""Prompt data of an online-RL run (`train.objective: grpo`): TRL's GRPO layouts in, prompt tokens out, with
every other column kept for the reward functions.

    {"prompt": "What is 2 + 3?", "answer": "5"}                      a string: [bos] + its tokens
    {"prompt": [{"role": "user", "content": "..."}], "answer": "5"}  messages (OpenAI or ShareGPT names):
                                                                    rendered with the chat template and its
                                                                    generation prompt, where the answer starts

Every key other than `prompt` is a column, passed to the rewards row by row (`columns_for`); a key missing
from some records reads as None there. A prompt longer than `rl.max_prompt_length` tokens keeps its end (the
question, next to the answer; bos stays first), as TRL keeps a prompt's last tokens; the cuts are counted and,
when more than `TRUNCATION_SHARE` are cut, `data.truncation = 'error'` refuses the data. A record without a
`prompt`, or whose prompt is empty, is refused with one paragraph naming the record.

Differences from TRL's GRPOTrainer: a string prompt starts with the tokenizer's bos (as zerofit's SFT and DPO
data do, so a model tuned by them sees the same start; TRL tokenizes without special tokens), and the text a
reward function receives as its prompt is the prompt as the model saw it (messages rendered through the chat
template), not TRL's list of messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError
from zerofit.data.chat import require_chat_template, tokenize_prompt
from zerofit.data.formats import _messages
from zerofit.data.records import RecordSource, open_source
from zerofit.data.sft import DataStats
from zerofit.data.tokenize import encode_tail, text_tail_within
from zerofit.data.truncation import TRUNCATION_RULES, TRUNCATION_SHARE

__all__ = ["PROMPT_KEY", "PromptData", "PromptExample", "columns_for", "load_prompts"]

PROMPT_KEY = "prompt"  # TRL's prompt column


@dataclass(frozen=True)
class PromptExample:
    """One prompt: its token ids (what the policy continues), its text as the model sees it (what a reward
    function receives), the record's other columns, the record it came from (0-based), and its messages
    (where a multi-turn rollout starts, rendered with the tools: `zerofit.data.agent_chat`)."""

    input_ids: list[int]
    text: str
    columns: dict[str, Any]
    record: int
    messages: list[dict[str, Any]] = field(default_factory=list)  # a string prompt: one user message


@dataclass
class PromptData:
    """A source's prompts, what loading did (`stats.format`: 'prompt' or 'conversational prompt'), and the
    names of the columns besides the prompt, in first-seen order."""

    prompts: list[PromptExample]
    stats: DataStats
    column_names: list[str] = field(default_factory=list)


def _string_prompt(tokenizer: Any, text: str, limit: int) -> tuple[list[int], str, bool]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids, cut = encode_tail(tokenizer, text, limit)
    if len(bos) + len(ids) > limit:
        ids, cut = ids[len(ids) - (limit - len(bos)) :], True
    shown = tokenizer.decode(ids) if cut else text
    return bos + ids, shown, cut


def _chat_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], limit: int, where: str
) -> tuple[list[int], str, bool]:
    messages = [{**m, "content": text_tail_within(tokenizer, m["content"], limit)} for m in messages]
    ids = tokenize_prompt(tokenizer, messages, where)
    cut = len(ids) > limit
    if cut:
        keep_first = int(bool(ids) and ids[0] == tokenizer.bos_token_id)
        ids = ids[:keep_first] + ids[len(ids) - (limit - keep_first) :]
    text = (
        tokenizer.decode(ids)
        if cut
        else tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    return ids, text, cut


def _prompt_value(record: dict[str, Any], where: str, source: RecordSource) -> str | list[dict[str, Any]]:
    """The record's prompt, checked: a non-empty string or a non-empty list of messages."""
    if PROMPT_KEY not in record:
        keys = ", ".join(repr(k) for k in record) or "none"
        raise DataError(
            f"{where}: no {PROMPT_KEY!r} key (keys present: {keys}); an online-RL run (train.objective grpo) reads "
            f"prompts in TRL's layout: {{'prompt': 'text', ...}} or {{'prompt': [messages], ...}}, every other key "
            f"a column for the reward functions. Rename the prompt field of {source.name} to 'prompt'."
        )
    value = record[PROMPT_KEY]
    messages = _messages(value, PROMPT_KEY, where) if not isinstance(value, str) else None
    empty = not value.strip() if messages is None else not any(m["content"].strip() for m in messages)
    if empty:
        raise DataError(
            f"{where}: the prompt is empty (nothing but whitespace), and the policy would generate from nothing; "
            "fill it in or remove the record."
        )
    return value if messages is None else messages


def _refuse_cut(stats: DataStats, limit: int, rule: str) -> None:
    if rule == "error" and stats.n_truncated > TRUNCATION_SHARE * stats.n_examples:
        raise DataError(
            f"{stats.source}: {stats.n_truncated:,} of {stats.n_examples:,} prompts ({stats.n_truncated / stats.n_examples:.0%}) "
            f"are longer than rl.max_prompt_length = {limit} tokens and would lose their start, and "
            "data.truncation = 'error' refuses such data. Raise rl.max_prompt_length, shorten the long prompts, "
            "or set data.truncation=warn to keep their ends (said in the run's plan)."
        )


def load_prompts(
    path: str | Path,
    tokenizer: Any,
    max_prompt_length: int,
    *,
    split: str = "train",
    subset: str | None = None,
    key: str = "data.path",
    truncation: str = "warn",
) -> PromptData:
    """The prompts of `path` (any source `data.path` takes), cut to `max_prompt_length` tokens by the rule
    of the module docstring; `truncation` is `data.truncation`."""
    if truncation not in TRUNCATION_RULES:
        raise ValueError(f"truncation must be one of {TRUNCATION_RULES}, not {truncation!r}")
    source = open_source(path, split=split, subset=subset, key=key)
    prompts: list[PromptExample] = []
    names: dict[str, None] = {}
    n_cut, chat = 0, False
    for index, (where, record) in enumerate(source):
        value = _prompt_value(record, where, source)
        if isinstance(value, list):
            if not chat:
                require_chat_template(tokenizer, f"{key} = {source.name!r}")
            chat = True
            ids, text, cut = _chat_prompt(tokenizer, value, max_prompt_length, where)
        else:
            ids, text, cut = _string_prompt(tokenizer, value, max_prompt_length)
        n_cut += cut
        columns = {k: v for k, v in record.items() if k != PROMPT_KEY}
        names.update(dict.fromkeys(columns))
        messages = value if isinstance(value, list) else [{"role": "user", "content": value}]
        prompts.append(PromptExample(ids, text, columns, index, messages))
    if not prompts:
        raise DataError(
            f"{source.describe()}: no prompts; add records such as {{'prompt': '...', 'answer': '...'}}."
        )
    fmt = "conversational prompt" if chat else "prompt"
    stats = DataStats(source.rows, len(prompts), n_cut, 0, format=fmt, source=source.describe())
    _refuse_cut(stats, max_prompt_length, truncation)
    return PromptData(prompts, stats, list(names))


def columns_for(
    prompts: Sequence[PromptExample], column_names: Sequence[str], repeat: int
) -> dict[str, list[Any]]:
    """The reward functions' columns for `repeat` completions of each prompt, in order (prompt 0's
    completions first): one list per column, one entry per completion (None where a record lacks it)."""
    return {name: [p.columns.get(name) for p in prompts for _ in range(repeat)] for name in column_names}
