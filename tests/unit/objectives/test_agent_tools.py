"""Agentic GRPO's tools (`zerofit.objectives.grpo.tools`) and call parsing (`.tool_calls`): the calculator
parses arithmetic from the AST (no eval), the lookup reads the row, every failure of a call is its reply and
a counted kind, and each family's call format parses."""

from __future__ import annotations

import time

import pytest

from zerofit.objectives.grpo.tool_calls import (
    fallback_system_text,
    hermes_call,
    parse_calls,
    template_format,
    tool_reply,
)
from zerofit.objectives.grpo.tools import BoundTool, calculator, lookup, lookup_in, run_call, tool_schema


def test_calculator_is_exact_arithmetic() -> None:
    assert calculator("(12 + 7) * 3") == "57"
    assert calculator("123456789 * 987654321") == str(123456789 * 987654321)
    assert calculator("7 / 2") == "3.5" and calculator("8 / 2") == "4" and calculator("-2 ** 3") == "-8"
    assert calculator("17 // 5 + 17 % 5") == "5"


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "x + 1",
        "print(1)",
        "[1, 2]",
        "2 ** 1000",
        "1 / 0",
        "'a' * 3",
        "1 +",
    ],
)
def test_calculator_refuses_all_but_arithmetic(expression: str) -> None:
    with pytest.raises(ValueError):
        calculator(expression)


def test_lookup_reads_the_rows_table() -> None:
    assert lookup_in({"a": "1", "b": 2})("b") == "2"
    assert lookup_in('{"capital": "Paris"}')("capital") == "Paris"
    with pytest.raises(KeyError, match="the keys are a"):
        lookup_in({"a": 1})("z")


def _tools() -> dict[str, BoundTool]:
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "late"

    def boom(x: int) -> str:
        raise RuntimeError("kaput")

    def returns_object(x: int) -> object:
        return object()

    def returns_list(x: int) -> list[int]:
        return [x, x]

    number = {"properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return {
        "calculator": BoundTool("calculator", calculator, tool_schema(calculator)["function"]["parameters"]),
        "slow": BoundTool(
            "slow", slow, {"properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
        ),
        "boom": BoundTool("boom", boom, number),
        "obj": BoundTool("obj", returns_object, number),
        "lst": BoundTool("lst", returns_list, number),
    }


@pytest.mark.parametrize(
    ("name", "arguments", "error", "reply"),
    [
        ("calculator", {"expression": "2+3"}, None, "5"),
        ("lst", {"x": 3}, None, "[3, 3]"),
        ("nope", {}, "unknown_tool", "no tool named 'nope'"),
        ("calculator", {"expr": "2"}, "bad_arguments", "missing ['expression'], unknown ['expr']"),
        ("calculator", {"expression": 2}, "bad_arguments", "must be of type string"),
        ("boom", {"x": True}, "bad_arguments", "must be of type integer"),
        ("calculator", "2+3", "bad_arguments", "must be a JSON object"),
        ("calculator", {"expression": "x"}, "raised", "ValueError"),
        ("boom", {"x": 1}, "raised", "RuntimeError: kaput"),
        ("slow", {"seconds": 5}, "timeout", "did not answer within 0.2 s"),
        ("obj", {"x": 1}, "bad_return", "returned a object"),
    ],
)
def test_every_failure_is_the_reply_and_its_kind(
    name: str, arguments: object, error: str | None, reply: str
) -> None:
    result = run_call(_tools(), name, arguments, 0.2)
    assert result.error == error and reply in result.reply, result


def test_each_family_format_parses() -> None:
    hermes = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    [call] = parse_calls("I will compute. " + hermes, "hermes")
    assert (call.name, call.arguments, call.malformed) == ("calculator", {"expression": "1+2"}, None)
    assert len(parse_calls(hermes + hermes, "hermes")) == 2
    assert parse_calls("<tool_call>{oops</tool_call>", "hermes")[0].malformed is not None
    assert parse_calls("<tool_call>{", "hermes")[0].malformed is not None  # never closed
    assert parse_calls("the answer is 3", "hermes") == []
    [llama] = parse_calls('<|python_tag|>{"name": "lookup", "parameters": {"key": "a"}}', "llama3")
    assert (llama.name, llama.arguments) == ("lookup", {"key": "a"})
    assert parse_calls("It is 4.", "llama3") == [] and parse_calls('{"name": 3}', "llama3")[0].malformed
    mistral = parse_calls(
        '[TOOL_CALLS][{"name": "a", "arguments": "{\\"k\\": 1}"}, {"name": "b"}]', "mistral"
    )
    assert [(c.name, c.arguments) for c in mistral] == [("a", {"k": 1}), ("b", {})]


def test_template_format_and_the_fallback() -> None:
    from zerofit.models.tiny import FAMILIES

    assert template_format(FAMILIES["tiny-qwen2"].template) == ("hermes", True)
    assert template_format(FAMILIES["tiny-llama3"].template) == ("llama3", True)
    assert template_format("{{ '[TOOL_CALLS]' }}") == ("mistral", True)
    assert template_format(FAMILIES["tiny-llama"].template) == ("hermes", False)
    assert tool_reply("calculator", "5", False, 1) == {
        "role": "user",
        "content": "<tool_response>\n5\n</tool_response>",
    }
    assert tool_reply("calculator", "5", True, 1)["tool_call_id"] == "call00001"


def test_the_fallback_shows_one_well_formed_call_and_its_reply() -> None:
    """A small model shown only the format never wrote a call (SmolLM2-135M: 0 of 24): the fallback's system
    turn ends with a one-shot example, a call `parse_calls` reads, the calculator's true reply and the answer;
    tools without an example (the user's own) get the format alone."""
    calc, look = tool_schema(calculator), tool_schema(lookup)
    text = fallback_system_text([look, calc])
    example = text.split("Example:\n", 1)[1]
    [call] = parse_calls(example, "hermes")
    assert (call.name, call.malformed) == ("calculator", None)
    assert tool_reply("calculator", calculator(**call.arguments), False, 0)["content"] in example
    assert example.endswith(f"The answer is {calculator(**call.arguments)}.")
    assert "Example:" not in fallback_system_text([look]) and "<tools>" in fallback_system_text([look])
    assert parse_calls(hermes_call("lookup", {"key": "a"}), "hermes")[0].arguments == {"key": "a"}
