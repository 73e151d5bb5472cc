"""Tool-calling conversations: the `tools` a record offers, the assistant's `tool_calls` and the `tool` results,
read from the OpenAI or the ShareGPT layout into one form, and the check that a chat template renders them.

One form for both layouts, the one transformers documents for `apply_chat_template(..., tools=...)`:

    tools        [{"type": "function", "function": {"name", "description"?, "parameters"?}}, ...]
    tool_calls   [{"type": "function", "function": {"name": str, "arguments": dict}, "id"?: str}, ...]

A tool given bare ({"name", "description", "parameters"}, LLaMA-Factory's ShareGPT `tools`) is wrapped; a list
given as a JSON string (how datasets store lists of differing schemas) is parsed. `arguments` given as a JSON
string (OpenAI's wire form) becomes an object: the family templates (Qwen2.5, Llama 3.1, Mistral) write it
with `| tojson`, which would quote a string a second time. ShareGPT's `function_call` turn (a JSON object or
list of `{"name", "arguments"}`) becomes an assistant message with those `tool_calls`; its `observation` turn
is a `tool` message (`formats.SHAREGPT_ROLES`).

A template that ignores `tools`, drops `tool_calls` or drops tool results would train on other text than the
data holds, silently; `require_tool_template` renders a probe conversation once per template and refuses one
whose text lacks any of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError

__all__ = [
    "has_tool_turns",
    "parse_tool_calls",
    "parse_tools",
    "read_tools_file",
    "require_tool_template",
    "sharegpt_function_call",
]

# The probe conversation `require_tool_template` renders: each marker must appear in the rendered text.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "zerofit_probe_tool",
        "description": "zerofit-probe-description",
        "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}}},
    },
}
_PROBE_MESSAGES = [
    {"role": "user", "content": "zerofit-probe-question"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call00001",  # 9 characters: Mistral's templates require that length
                "type": "function",
                "function": {"name": "zerofit_probe_tool", "arguments": {"probe_arg": "zerofit-probe-value"}},
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call00001",
        "name": "zerofit_probe_tool",
        "content": "zerofit-probe-result",
    },
    {"role": "assistant", "content": "zerofit-probe-answer"},
]
_PROBE_MARKERS = (
    ("the tool definitions (tools=)", "zerofit-probe-description"),
    ("the assistant's tool call (tool_calls)", "zerofit-probe-value"),
    ("the tool result (a 'tool' message)", "zerofit-probe-result"),
)
# template text -> None (renders tools) or what it lacks; a template is probed once per process.
_CHECKED: dict[str, str | None] = {}


def _json(value: Any, what: str, where: str) -> Any:
    """`value` parsed from JSON when it is a string, else as it is; DataError naming `what` otherwise."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise DataError(
            f"{where}: {what} is a string that is not valid JSON ({exc}: {value!r:.80}); write it as a JSON "
            "object / list, or as a string holding one."
        ) from None


def parse_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A record's `tools` in transformers' form (see module doc); None when it has none."""
    value = _json(value, "'tools'", where)
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise DataError(
            f"{where}: 'tools' must be a list of function schemas (or a JSON string of one), got "
            f'{type(value).__name__}; e.g. [{{"type": "function", "function": {{"name": "get_weather", '
            '"description": "...", "parameters": {...}}}].'
        )
    tools = []
    for i, tool in enumerate(value):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(
                f"{where}: tool {i} ({tool!r:.80}) is no function schema: each tool needs a 'name' (string), "
                'as {"type": "function", "function": {"name": ..., "parameters": ...}} or bare {"name": ...}.'
            )
        tools.append({"type": "function", "function": function})
    return tools


def read_tools_file(path: str) -> list[dict[str, Any]]:
    """`data.tools_file`: the tools (a JSON list of function schemas) of every conversation without its own;
    DataError naming the key when the file cannot be read or holds no tools."""
    where = f"data.tools_file = {path!r}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{where}: cannot read it ({type(exc).__name__}: {exc}); point data.tools_file at a JSON file "
            "holding a list of tool schemas, or leave it unset and give each record its own 'tools'."
        ) from None
    tools = parse_tools(text, where)
    if tools is None:
        raise DataError(f"{where}: the file holds no tools (an empty list); list the tool schemas in it.")
    return tools


def _call(raw: Any, where: str, index: int) -> dict[str, Any]:
    """One tool call in transformers' form, from OpenAI's ({"function": {...}}) or a bare {"name", "arguments"}."""
    function = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(
            f"{where}: message {index} has a tool call without a function name ({raw!r:.80}); each call is "
            '{"type": "function", "function": {"name": ..., "arguments": {...}}} (or {"name", "arguments"}).'
        )
    arguments = _json(function.get("arguments", {}), f"message {index}'s tool-call arguments", where)
    if not isinstance(arguments, dict):
        raise DataError(
            f"{where}: message {index} calls {function['name']!r} with arguments of type "
            f"{type(arguments).__name__}; arguments are a JSON object (or a string holding one)."
        )
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
    if isinstance(raw, dict) and raw.get("id") is not None:
        call["id"] = raw["id"]
    return call


def parse_tool_calls(value: Any, where: str, index: int) -> list[dict[str, Any]] | None:
    """An assistant message's `tool_calls` in transformers' form; None when there are none (an empty list
    is none: Llama 3.1's template takes any `tool_calls` key as a call)."""
    value = _json(value, f"message {index}'s 'tool_calls'", where)
    if value is None or value == []:
        return None
    calls = value if isinstance(value, list) else [value]
    return [_call(c, where, index) for c in calls]


def sharegpt_function_call(value: Any, where: str, index: int) -> dict[str, Any]:
    """A ShareGPT `function_call` turn (LLaMA-Factory's layout: JSON of one call or a list of calls) as the
    assistant message it is."""
    calls = parse_tool_calls(value, where, index)
    if not calls:
        raise DataError(f"{where}: message {index} is a function_call turn without a call ({value!r:.80}).")
    return {"role": "assistant", "content": "", "tool_calls": calls}


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds tool calls or tool results (which a template must render)."""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def _lacks(tokenizer: Any, template: str) -> str | None:
    """What of the probe conversation `template` leaves out of its text (None: it renders all of it)."""
    if template not in _CHECKED:
        try:
            text = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], tokenize=False)
        except Exception as exc:  # the template's raise_exception(...) or a Jinja error on the tool turns
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _CHECKED[template] = f"a conversation with a tool call and its result (it raised: {first})"
        else:
            missing = [what for what, marker in _PROBE_MARKERS if marker not in text]
            _CHECKED[template] = ", ".join(missing) or None
    return _CHECKED[template]


def require_tool_template(tokenizer: Any, template: str, where: str) -> None:
    """DataError naming the model and the fix when `template` cannot render tools, tool calls and results."""
    missing = _lacks(tokenizer, template)
    if missing is None:
        return
    name = getattr(tokenizer, "name_or_path", "") or "this model"
    raise DataError(
        f"{where}: this conversation has tools, tool calls or tool results, but the chat template of {name} "
        f"cannot render them: rendering a probe conversation with tools= left out {missing}, so the model "
        "would train on other text than the data holds. Use a model whose chat template supports tools "
        "(the instruct models of Qwen2.5, Qwen3, Llama 3.1, Mistral ship one; built in: tiny-qwen2, tiny-llama3), "
        "or set data.chat_template "
        "to a template that renders `tools`, assistant `tool_calls` and `tool` messages."
    )
