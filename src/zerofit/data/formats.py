"""How a record is laid out (`data.format`), told from its keys, and checked into one typed value.

    prompt_response   {"prompt": str, "response": str}                    loss on the response
    alpaca            {"instruction": str, "input": str?, "output": str}  the Alpaca prompt; loss on output
    messages          {"messages": [{"role", "content"}, ...]} (OpenAI) or
                      {"conversations": [{"from", "value"}, ...]} (ShareGPT)   chat template; loss on
                                                                           every assistant turn
                      with `tools`, `tool_calls` and `tool` turns in either layout (data/tools.py)
    preference        {"prompt", "chosen", "rejected"} (TRL's layout): strings, or conversational (`prompt` a
                      list of messages, `chosen` / `rejected` lists of assistant messages; `prompt` may be
                      left out when both are whole conversations or texts sharing it: the implicit
                      prompt, their shared messages or TRL's common-prefix rule for strings)
                                                                           preference objectives only
    text              {"text": str}                                       continued pre-training; loss on all

`auto` decides from the first record's keys (messages, alpaca, preference, prompt_response, text: in that
order) and says what it saw when nothing fits. Every record is then checked against that one format; a problem names the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofit.core.errors import DataError
from zerofit.data.tools import parse_tool_calls, parse_tools, sharegpt_function_call

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "FORMATS",
    "Conversation",
    "Document",
    "Preference",
    "PromptResponse",
    "alpaca_prompt",
    "detect_format",
    "parse_record",
]

FORMATS = ("prompt_response", "alpaca", "messages", "text", "preference")

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
    "function_call": "assistant",  # LLaMA-Factory's tool-call turn: its value is the call (data/tools.py)
}

# What `auto` looks for, in order: (format, keys that must all be there, how to say it).
_SIGNATURES: tuple[tuple[str, tuple[tuple[str, ...], ...], str], ...] = (
    ("messages", (("messages",), ("conversations",)), "'messages' (OpenAI) or 'conversations' (ShareGPT)"),
    ("alpaca", (("instruction", "output"),), "'instruction' and 'output' (optional 'input')"),
    (
        "preference",
        (("prompt", "chosen", "rejected"), ("chosen", "rejected")),
        "'prompt', 'chosen' and 'rejected' (TRL's preference layout; no 'prompt' when chosen and rejected are "
        "whole conversations or texts that share it)",
    ),
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
    """Chat messages with `role` and `content` (ShareGPT names already mapped); assistant turns are learned.
    `tools`: the record's tool schemas, passed to the chat template (`data/tools.py`); None without."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Document:
    """Plain text for continued pre-training: every token is learned."""

    text: str


@dataclass(frozen=True)
class Preference:
    """A preference pair's record: one prompt and two responses to it, the chosen (better) and the rejected.

    Strings (`prompt` the text before either response), or conversational: `prompt` a list of messages and
    `chosen` / `rejected` lists of assistant messages (ShareGPT names already mapped), learned on those.
    """

    prompt: str | list[dict[str, Any]]
    chosen: str | list[dict[str, Any]]
    rejected: str | list[dict[str, Any]]

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


Parsed = PromptResponse | Conversation | Document | Preference


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
    if all(k in record for k in ("prompt", "completion", "label")):  # TRL's unpaired layout
        hint += "; 'prompt', 'completion' and 'label' are KTO's unpaired feedback: set train.objective=kto"
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
    if "role" in raw and ("content" in raw or raw.get("tool_calls")):
        role, content = raw["role"], raw.get("content")
        extra = {k: v for k, v in raw.items() if k not in ("role", "content") and v is not None}
        calls = parse_tool_calls(extra.pop("tool_calls", None), where, index)
        if calls:  # OpenAI's tool calls: content may be null, arguments a JSON string (data/tools.py)
            extra, content = {**extra, "tool_calls": calls}, content or ""
    elif raw.get("from") == "function_call" and "value" in raw:
        return sharegpt_function_call(raw["value"], where, index)
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
    if fmt == "preference":
        return _preference(record, where)
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
        tools = parse_tools(record.get("tools"), where)
        return Conversation([_message(m, where, i) for i, m in enumerate(raw)], tools)
    raise ValueError(f"unknown data format {fmt!r}")


def _messages(value: Any, key: str, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise DataError(f"{where}: {key!r} must be a list of messages, got {type(value).__name__}.")
    return [_message(m, where, i) for i, m in enumerate(value)]


def _implicit_prompt(
    chosen: list[dict[str, Any]], rejected: list[dict[str, Any]], where: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """TRL's implicit prompt: the messages both conversations share, up to the first assistant message in
    which they part; (prompt, chosen's rest, rejected's rest)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and chosen[n - 1]["role"] == "assistant" and (n == len(chosen) or n == len(rejected)):
        n -= 1  # a last turn both share is the response (an identical pair, dropped as such), not prompt
    if n == 0:
        raise DataError(
            f"{where}: 'chosen' and 'rejected' have no 'prompt' and share no leading messages, so there is no "
            "prompt to prefer one over the other for; add a 'prompt' key (a list of messages)."
        )
    return chosen[:n], chosen[n:], rejected[n:]


def _preference(record: dict[str, Any], where: str) -> Preference:
    """A `preference` record in either layout (strings, or conversational, with or without a prompt)."""
    for key in ("chosen", "rejected"):
        if key not in record:
            _string(record, key, where, "preference")  # raises: missing key
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, list) or isinstance(rejected, list):
        c, r = _messages(chosen, "chosen", where), _messages(rejected, "rejected", where)
        if prompt is None:
            p, c, r = _implicit_prompt(c, r, where)
        elif isinstance(prompt, list):
            p = _messages(prompt, "prompt", where)
        else:
            raise DataError(
                f"{where}: 'chosen' / 'rejected' are lists of messages but 'prompt' is a "
                f"{type(prompt).__name__}; in TRL's conversational layout 'prompt' is a list of messages too "
                '(e.g. [{"role": "user", "content": "..."}]), or all three are strings.'
            )
        for key, turns in (("chosen", c), ("rejected", r)):
            if any(m["role"] != "assistant" for m in turns):
                roles = ", ".join(repr(m["role"]) for m in turns)
                raise DataError(
                    f"{where}: {key!r} holds messages of roles {roles}; in TRL's conversational preference "
                    "layout it holds only the assistant's response (the rest belongs in 'prompt')."
                )
        return Preference(p, c, r)
    c, r = _string(record, "chosen", where, "preference"), _string(record, "rejected", where, "preference")
    if prompt is None:
        return _implicit_string_prompt(c, r, where)
    return Preference(_string(record, "prompt", where, "preference"), c, r)


def _implicit_string_prompt(chosen: str, rejected: str, where: str) -> Preference:
    """TRL's implicit prompt for strings (`extract_prompt`): the longest common prefix of both texts, less
    a space it ends with (that space starts the responses)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n and n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    if n == 0:
        raise DataError(
            f"{where}: 'chosen' and 'rejected' have no 'prompt' and share no beginning, so there is no prompt "
            "to prefer one over the other for; add a 'prompt' key (TRL's explicit layout)."
        )
    return Preference(chosen[:n], chosen[n:], rejected[n:])
