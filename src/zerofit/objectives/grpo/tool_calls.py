"""The tool calls in an assistant turn, parsed in the model family's format, and which format a template uses.

    hermes    Qwen2.5 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number;
    llama3    Llama 3.1: the whole turn one JSON object `{"name": ..., "parameters": {...}}` (after an
              optional `<|python_tag|>`);
    mistral   Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.

`template_format` reads the chat template's text: `<tool_call>` -> hermes, `[TOOL_CALLS]` -> mistral,
`<|python_tag|>` or `ipython` -> llama3; a template with none of them (SmolLM2's, the built-in tiny models')
has no tools section and gets the documented fallback: hermes calls, the tools listed in the system turn
(`fallback_system_text`, ending with a one-shot example of a call, its reply and the answer when a built-in
with an example is offered) and each reply sent back as a user turn in `<tool_response>` tags (Hermes' own
layout), so any template renders them.

A turn that starts a call but whose JSON does not parse, or lacks a name, is one call with the error kind
`malformed` (counted, and answered with that error: `zerofit.objectives.grpo.tools`).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from zerofit.objectives.grpo.tools import BUILTIN_TOOLS, EXAMPLE_CALLS

__all__ = [
    "FORMATS",
    "ParsedCall",
    "fallback_system_text",
    "hermes_call",
    "parse_calls",
    "template_format",
    "tool_reply",
]

FORMATS = ("hermes", "llama3", "mistral")
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    """One call: the tool's name and arguments, or `malformed` set (with what the model wrote)."""

    name: str
    arguments: Any
    malformed: str | None = None


def template_format(template: str | None) -> tuple[str, bool]:
    """The call format of a chat template, and whether the template renders tools itself (False: the
    fallback)."""
    text = template or ""
    if "<tool_call>" in text:
        return "hermes", True
    if _MISTRAL in text:
        return "mistral", True
    if _PYTHON_TAG in text or "ipython" in text:
        return "llama3", True
    return "hermes", False


def _one(obj: Any, raw: str, arguments_key: str) -> ParsedCall:
    """A decoded call object as a `ParsedCall` (arguments given as JSON text are decoded too)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall("", None, f"a call needs a JSON object with a name: {raw.strip()[:200]}")
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):
        with contextlib.suppress(
            json.JSONDecodeError
        ):  # else left as text: run_call says it must be an object
            arguments = json.loads(arguments)
    return ParsedCall(obj["name"], arguments)


def _decoded(raw: str, arguments_key: str) -> list[ParsedCall]:
    """The calls in one JSON text (an object, or a list of them); one malformed call when it is not JSON."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return [ParsedCall("", None, f"not JSON: {raw.strip()[:200]}")]
    items = obj if isinstance(obj, list) else [obj]
    return [_one(item, raw, arguments_key) for item in items] or [ParsedCall("", None, "an empty call list")]


def parse_calls(text: str, fmt: str) -> list[ParsedCall]:
    """Every call in an assistant turn's text (special tokens kept), in `fmt` (`FORMATS`); [] for none."""
    if fmt == "hermes":
        return [c for raw in _HERMES.findall(text) for c in _decoded(raw, "arguments")]
    if fmt == "mistral":
        if _MISTRAL not in text:
            return []
        return _decoded(text.split(_MISTRAL, 1)[1], "arguments")
    if fmt == "llama3":
        body = text.split(_PYTHON_TAG, 1)[1] if _PYTHON_TAG in text else text
        if not body.strip().startswith("{"):
            return []
        return _decoded(body.strip(), "parameters")
    raise ValueError(f"tool-call format {fmt!r}: expected one of {FORMATS}")


def fallback_system_text(schemas: list[dict[str, Any]]) -> str:
    """The system turn that offers the tools to a template without a tools section (Hermes' wording), then a
    one-shot example: a well-formed call, its reply and the answer, for the first offered built-in that has
    one (`EXAMPLE_CALLS`), since a small model shown only the format rarely writes a call at all."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    text = (
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        f"signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    names = [s.get("function", {}).get("name") for s in schemas]
    shown = next((n for n in names if n in EXAMPLE_CALLS), None)
    if shown is None:
        return text
    arguments = EXAMPLE_CALLS[shown]
    reply = str(BUILTIN_TOOLS[shown][0](**arguments))
    response = tool_reply(shown, reply, native=False, index=0)["content"]
    return f"{text}\n\nExample:\n{hermes_call(shown, arguments)}\n{response}\nThe answer is {reply}."


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """One well-formed call in the fallback's (Hermes') format, as `parse_calls` reads it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def tool_reply(name: str, reply: str, native: bool, index: int) -> dict[str, Any]:
    """The message that carries a tool's reply: a `tool` message for a template with a tools section (a
    9-character call id, as Mistral's templates require), else a user turn in `<tool_response>` tags."""
    if native:
        return {"role": "tool", "name": name, "content": reply, "tool_call_id": f"call{index:05d}"}
    return {"role": "user", "content": f"<tool_response>\n{reply}\n</tool_response>"}
