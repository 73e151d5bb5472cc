"""How a record is laid out (`data.format`), told from its keys, and checked into one typed value.

    prompt_response   {"prompt": str, "response": str}                    loss on the response
    alpaca            {"instruction": str, "input": str?, "output": str}  the Alpaca prompt; loss on output
    messages          {"messages": [{"role", "content"}, ...]} (OpenAI) or
                      {"conversations": [{"from", "value"}, ...]} (ShareGPT)   chat template; loss on
                                                                           every assistant turn
    text              {"text": str}                                       continued pre-training; loss on all

`auto` decides from the first record's keys (in the order above, messages first) and says what it saw when
nothing fits. Every record is then checked against that one format; a problem names the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofit.errors import DataError

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "FORMATS",
    "Conversation",
    "Document",
    "PromptResponse",
    "alpaca_prompt",
    "detect_format",
    "parse_record",
]

FORMATS = ("prompt_response", "alpaca", "messages", "text")

# The prompts of Stanford Alpaca (github.com/tatsu-lab/stanford_alpaca), as alpaca-format trainers use them.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

# ShareGPT speaker names -> chat-template roles (OpenAI-style `role` values are used as they are).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

# What `auto` looks for, in order: (format, keys that must all be there, how to say it).
_SIGNATURES: tuple[tuple[str, tuple[tuple[str, ...], ...], str], ...] = (
    ("messages", (("messages",), ("conversations",)), "'messages' (OpenAI) or 'conversations' (ShareGPT)"),
    ("alpaca", (("instruction", "output"),), "'instruction' and 'output' (optional 'input')"),
    ("prompt_response", (("prompt", "response"),), "'prompt' and 'response'"),
    ("text", (("text",),), "'text'"),
)


@dataclass(frozen=True)
class PromptResponse:
    """A prompt (masked from the loss) and the response to learn (`prompt_response`, `alpaca`)."""

    prompt: str
    response: str


@dataclass(frozen=True)
class Conversation:
    """Chat messages with `role` and `content` (ShareGPT names already mapped); assistant turns are learned."""

    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class Document:
    """Plain text for continued pre-training: every token is learned."""

    text: str


Parsed = PromptResponse | Conversation | Document


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    """The Alpaca prompt for an instruction and optional input (the model's answer follows it)."""
    if input_text:
        return ALPACA_PROMPT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def _keys_list(record: dict[str, Any]) -> str:
    return ", ".join(repr(k) for k in record) or "none"


def detect_format(record: dict[str, Any], where: str, key: str = "data.path") -> str:
    """The format of `record` (the first of a source), from its keys; DataError listing what was seen."""
    for fmt, alternatives, _ in _SIGNATURES:
        if any(all(k in record for k in keys) for keys in alternatives):
            return fmt
    # Nothing fits: name the keys seen, what each format needs, and the closest misses.
    needs = "; ".join(f"{fmt} needs {said}" for fmt, _, said in _SIGNATURES)
    near = [
        f"for {fmt}: missing key {missing!r}"
        for fmt, alternatives, _ in _SIGNATURES
        for keys in alternatives
        if any(k in record for k in keys)
        for missing in keys
        if missing not in record
    ]
    hint = f" ({'; '.join(near)})" if near else ""
    raise DataError(
        f"{where}: cannot tell the data format of {key} from this record's keys: {_keys_list(record)}{hint}. "
        f"data.format=auto recognizes: {needs}. Rename the fields, or set data.format to the format the "
        "file is in."
    )


def _string(record: dict[str, Any], key: str, where: str, fmt: str, *, optional: bool = False) -> str:
    if key not in record or (optional and record[key] is None):
        if optional:
            return ""
        needs = next(said for name, _, said in _SIGNATURES if name == fmt)
        raise DataError(
            f"{where}: missing key {key!r} (keys present: {_keys_list(record)}); each {fmt} record needs "
            f"{needs}."
        )
    value = record[key]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: {key!r} must be a string, got {type(value).__name__} ({value!r:.60}); convert it to text "
            "in the data file."
        )
    return value


def _content(value: Any, where: str, index: int) -> str:
    """Message content as text: a string, or OpenAI content parts of type text (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text") or "") for p in value)
    raise DataError(
        f"{where}: message {index} has content of type {type(value).__name__} ({value!r:.60}); content must "
        "be a string (or a list of {'type': 'text', 'text': ...} parts)."
    )


def _message(raw: Any, where: str, index: int) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise DataError(
            f"{where}: message {index} is a {type(raw).__name__}, not an object with role/content."
        )
    if "role" in raw and "content" in raw:
        role, content = raw["role"], raw["content"]
        extra = {k: v for k, v in raw.items() if k not in ("role", "content") and v is not None}
    elif "from" in raw and "value" in raw:
        speaker = raw["from"]
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise DataError(
                f"{where}: message {index} is from {speaker!r}, which is no ShareGPT speaker zerofit knows "
                f"({', '.join(SHAREGPT_ROLES)}); rename it in the data file."
            )
        content, extra = raw["value"], {}
    else:
        raise DataError(
            f"{where}: message {index} has keys {_keys_list(raw)}; each message needs 'role' and 'content' "
            "(OpenAI) or 'from' and 'value' (ShareGPT)."
        )
    if not isinstance(role, str):
        raise DataError(
            f"{where}: message {index} has a role of type {type(role).__name__}; it must be a string."
        )
    return {**extra, "role": role, "content": _content(content, where, index)}


def parse_record(fmt: str, record: dict[str, Any], where: str) -> Parsed:
    """`record` checked against `fmt` and turned into its typed value; DataError naming `where` otherwise."""
    if fmt == "prompt_response":
        return PromptResponse(_string(record, "prompt", where, fmt), _string(record, "response", where, fmt))
    if fmt == "alpaca":
        instruction = _string(record, "instruction", where, fmt)
        input_text = _string(record, "input", where, fmt, optional=True)
        return PromptResponse(alpaca_prompt(instruction, input_text), _string(record, "output", where, fmt))
    if fmt == "text":
        return Document(_string(record, "text", where, fmt))
    if fmt == "messages":
        key = "messages" if "messages" in record else "conversations"
        raw = record.get(key)
        if raw is None:
            raise DataError(
                f"{where}: missing key 'messages' (keys present: {_keys_list(record)}); each messages record "
                "needs 'messages' (OpenAI) or 'conversations' (ShareGPT): a list of messages."
            )
        if not isinstance(raw, list):
            raise DataError(f"{where}: {key!r} must be a list of messages, got {type(raw).__name__}.")
        return Conversation([_message(m, where, i) for i, m in enumerate(raw)])
    raise ValueError(f"unknown data format {fmt!r}")
