"""Chat conversations -> token ids and an assistant-only loss mask, through the tokenizer's chat template.

Which tokens are the assistant's is read from the template itself, in one of two ways:

1. The template marks assistant text with `{% generation %}...{% endgeneration %}`: transformers'
   `apply_chat_template(..., return_assistant_tokens_mask=True)` returns the mask (tiny-llama's template
   does this).
2. Otherwise (most shipped templates): each assistant turn's text is what rendering the conversation up to
   and including that turn adds to rendering it up to the turn before, with the generation prompt. Those
   character spans of the whole rendering become token positions through the tokenizer's offsets. This
   needs a template that renders a conversation's beginning the same way whatever follows; one that does
   not (some rewrite earlier turns) is refused with the fix (a template with `{% generation %}`).

Every assistant turn is learned, not only the last, its tool calls included; `tool` results, like the tools
preamble the template writes from `tools=`, are not (`data/tools.py`). A long message is cut to the text that
can still fit in `max_seq_len` before rendering (see `tokenize.py`), so a huge turn never reaches the
tokenizer whole.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError
from zerofit.data.tokenize import text_within
from zerofit.data.tools import has_tool_turns, require_tool_template

__all__ = [
    "has_generation_marks",
    "require_chat_template",
    "set_chat_template",
    "template_file",
    "tokenize_conversation",
    "tokenize_prompt",
]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_marks(template: str) -> bool:
    """True when the template marks assistant text with `{% generation %}` (transformers' assistant mask)."""
    return bool(_GENERATION.search(template))


def set_chat_template(tokenizer: Any, value: str | None) -> None:
    """Install `data.chat_template` (Jinja text, or the path of a file holding it) on the tokenizer.

    Saved with the tokenizer at export, so generation later renders prompts the way training did.
    """
    if value is None:
        return
    path = template_file(value)
    tokenizer.chat_template = (
        path.read_text(encoding="utf-8") if path is not None and path.is_file() else value
    )


def template_file(value: str) -> Path | None:
    """The path `data.chat_template` names, or None when `value` is the template text itself (Jinja has a
    `{`; a value without one must name a file, which `resolve()` checks): one rule, in training and at export."""
    return None if "{" in value else Path(value).expanduser()


def require_chat_template(tokenizer: Any, source: str) -> str:
    """The tokenizer's chat template; DataError with the fix when it has none (checked before tokenizing)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: transformers uses "default"
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or "this model"
        raise DataError(
            f"{source} holds chat messages, which are rendered with the tokenizer's chat template, but the "
            f"tokenizer of {name} has none (base models often ship without one). Set data.chat_template to "
            "a Jinja template, as text or the path of a .jinja file (for example the template of the model's "
            "instruct variant), or convert the data to prompt_response."
        )
    return str(template)


def _render(tokenizer: Any, messages: list[dict[str, Any]], where: str, **kwargs: Any) -> Any:
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as exc:  # jinja2.TemplateError, or the template's own raise_exception(...)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"{where}: the chat template refused this conversation ({text}); fix the conversation (role "
            "order, roles the template knows), or set data.chat_template to a template that accepts it."
        ) from None


def _assistant_spans(
    tokenizer: Any, messages: list[dict[str, Any]], where: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of every assistant turn in it (see module doc); a
    tool call is the assistant's turn, a tool result is not (each is its own message)."""
    full = _render(tokenizer, messages, where, tokenize=False, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = (
            _render(tokenizer, messages[:i], where, tokenize=False, add_generation_prompt=True, tools=tools)
            if i
            else ""
        )
        upto = _render(tokenizer, messages[: i + 1], where, tokenize=False, tools=tools)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"{where}: the chat template renders the start of this conversation differently once later "
                f"turns follow (it is not prefix-stable at message {i}), so zerofit cannot tell which tokens are "
                "the assistant's. Set data.chat_template to a template that marks assistant text with "
                "{% generation %}...{% endgeneration %}."
            )
        spans.append((len(before), len(upto)))
    return full, spans


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens overlapping an assistant span (as transformers' own assistant mask does); spans are in order."""
    mask = [False] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = end > spans[k][0]
    return mask


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_seq_len: int,
    where: str,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[bool], bool]:
    """(token ids, assistant mask, truncated) of one conversation, at most `max_seq_len` tokens long; `tools`
    (the record's tool schemas) go to the template, which must render them (`require_tool_template`)."""
    if not messages:
        return [], [], False
    messages = [{**m, "content": text_within(tokenizer, m["content"], max_seq_len)} for m in messages]
    template = require_chat_template(tokenizer, where)
    if tools or has_tool_turns(messages):
        require_tool_template(tokenizer, template, where)
    if has_generation_marks(template):
        out = _render(
            tokenizer,
            messages,
            where,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            tools=tools,
        )
        ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                f"{where}: assistant turns are found through token offsets, which need a fast tokenizer, and "
                f"{type(tokenizer).__name__} is not one; use the model's fast tokenizer (tokenizer.json), or a "
                "data.chat_template with {% generation %} marks."
            )
        text, spans = _assistant_spans(tokenizer, messages, where, tools)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, mask = list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)
    truncated = len(ids) > max_seq_len
    return ids[:max_seq_len], mask[:max_seq_len], truncated


def tokenize_prompt(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> list[int]:
    """Token ids of `messages` rendered as a prompt: with the template's generation prompt, where the
    assistant's answer starts (a preference pair's shared prompt; its contents are not cut)."""
    out = _render(tokenizer, messages, where, tokenize=True, return_dict=True, add_generation_prompt=True)
    return list(out["input_ids"])
