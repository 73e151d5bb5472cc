"""Token ids of text, never handing the tokenizer more text than a sequence can hold.

A fast tokenizer keeps a few hundred bytes of bookkeeping per token (offsets, token strings, word ids)
until the call returns: tokenizing one 2 MB response whole to keep 64 of its tokens peaked at 780 MB, and a
50 MB line at about 19 GB. So:

- `encode_head` tokenizes only a leading part of a text, long enough for the tokens a sequence keeps plus
  a margin (`SLACK_TOKENS`), doubling it while it is too short;
- `text_within` cuts a text to such a leading part (chat contents, which the template renders);
- `encode_tail` / `text_tail_within` do the same for a trailing part (a preference pair's prompt, whose
  end, next to the response, is what a cut keeps: the margin then lies at the part's start);
- `encode_document` yields every token of a long text (continued pre-training), tokenizing windows of
  `WINDOW_CHARS` characters cut before whitespace;
- `ending_in_eos` ends a response's (or a document's) tokens in one eos: appended unless the text already
  ends in it (TRL's rule: a response written with its eos gets no second one).

A cut can change the tokens at its very end (the last word, split differently); those lie in the margin
beyond what is kept, and a window cut before whitespace is where tokenizers split words anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = [
    "SLACK_TOKENS",
    "WINDOW_CHARS",
    "encode_document",
    "encode_head",
    "encode_tail",
    "ending_in_eos",
    "text_tail_within",
    "text_within",
]

SLACK_TOKENS = 16  # tokens tokenized beyond what is kept, so a cut never reaches the kept ones
WINDOW_CHARS = 1 << 18  # characters per tokenizer call for long documents (~100 MB of bookkeeping at most)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _first_size(max_tokens: int) -> int:
    # Tokens are rarely longer than 4 characters on average; doubling covers the texts where they are.
    return max(4 * (max_tokens + SLACK_TOKENS), 1024)


def encode_head(tokenizer: Any, text: str, max_tokens: int) -> tuple[list[int], bool]:
    """`(ids, cut)`: all token ids of `text` with `cut` False, or, for a text of more than `max_tokens` +
    `SLACK_TOKENS` tokens, its first `max_tokens` ids with `cut` True (no special tokens added)."""
    chars = _first_size(max_tokens)
    while chars < len(text):
        ids = _encode(tokenizer, text[:chars])
        if len(ids) >= max_tokens + SLACK_TOKENS:
            return ids[:max_tokens], True
        chars *= 2
    return _encode(tokenizer, text), False


def text_within(tokenizer: Any, text: str, max_tokens: int) -> str:
    """`text`, or its leading part that already holds more than `max_tokens` tokens (a short text is not
    tokenized at all): what follows could not fit in a sequence of `max_tokens` anyway."""
    chars = _first_size(max_tokens)
    while chars < len(text):
        if len(_encode(tokenizer, text[:chars])) >= max_tokens + SLACK_TOKENS:
            return text[:chars]
        chars *= 2
    return text


def encode_tail(tokenizer: Any, text: str, max_tokens: int) -> tuple[list[int], bool]:
    """`(ids, cut)`: all token ids of `text` with `cut` False, or, for a text of more than `max_tokens` +
    `SLACK_TOKENS` tokens, its last `max_tokens` ids with `cut` True (no special tokens added)."""
    chars = _first_size(max_tokens)
    while chars < len(text):
        ids = _encode(tokenizer, text[-chars:])
        if len(ids) >= max_tokens + SLACK_TOKENS:
            return ids[len(ids) - max_tokens :], True
        chars *= 2
    return _encode(tokenizer, text), False


def text_tail_within(tokenizer: Any, text: str, max_tokens: int) -> str:
    """`text`, or its trailing part that already holds more than `max_tokens` tokens (`text_within` from
    the end)."""
    chars = _first_size(max_tokens)
    while chars < len(text):
        if len(_encode(tokenizer, text[-chars:])) >= max_tokens + SLACK_TOKENS:
            return text[-chars:]
        chars *= 2
    return text


def encode_document(tokenizer: Any, text: str) -> Iterator[list[int]]:
    """Every token id of `text`, window by window (concatenate them for the document's tokens)."""
    pos = 0
    while pos < len(text):
        end = min(len(text), pos + WINDOW_CHARS)
        if end < len(text):
            # Cut before whitespace, where tokenizers split words anyway: the tokens stay those of the whole.
            cut = max(text.rfind(ch, pos + 1, end) for ch in " \n\t")
            if cut > pos:
                end = cut
        yield _encode(tokenizer, text[pos:end])
        pos = end


def ending_in_eos(ids: list[int], eos_id: int) -> list[int]:
    """`ids` ending in exactly the one eos it needs: `eos_id` appended unless the last id already is it.

    A text that ends in the eos token's string (`"...</s>"`) tokenizes to ids ending in eos, and appending
    another would teach the model to say eos twice; TRL checks the same (`text.endswith(eos_token)`) before
    adding its eos, for SFT and preference data alike.
    """
    return ids if ids and ids[-1] == eos_id else [*ids, eos_id]
