"""`rl.tools` / `rl.environment` -> the run's agent at launch (`zerofit.recipe.tools`): built-ins by name, the
user's `module:function` imported, a tool whose schema cannot be built refused in one paragraph naming the
function and what is missing; the chat template renders the tools (a tools section, or the fallback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zerofit.config.schema import ToolSpec
from zerofit.core.errors import ConfigError
from zerofit.data.agent_chat import AgentChat
from zerofit.models.tiny import build_tokenizer
from zerofit.recipe.tools import build_tools

USER_TOOLS = '''
def weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return "sunny in " + city


def untyped(city):
    """No hints.

    Args:
        city: The city.
    """


def undocumented(city: str) -> str:
    return city
'''


@pytest.fixture
def user_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "zerofit_user_tools.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "zerofit_user_tools"
    sys.modules.pop("zerofit_user_tools", None)


def test_builtins_and_a_user_tool(user_tools: str) -> None:
    specs = [
        ToolSpec(function="calculator"),
        ToolSpec(function="lookup", column="facts"),
        ToolSpec(function=f"{user_tools}:weather"),
    ]
    schemas, makers = build_tools(specs)
    assert [s["function"]["name"] for s in schemas] == ["calculator", "lookup", "weather"]
    assert schemas[2]["function"]["parameters"]["required"] == ["city"]
    row = {"facts": {"a": "1"}}
    bound = [make(row) for make in makers]
    assert bound[0].fn("2*3") == "6" and bound[1].fn("a") == "1" and bound[2].fn("Oslo") == "sunny in Oslo"


def test_a_schema_that_cannot_be_built_is_one_paragraph_naming_the_function(user_tools: str) -> None:
    specs = [
        ToolSpec(function=f"{user_tools}:untyped"),
        ToolSpec(function=f"{user_tools}:undocumented"),
        ToolSpec(function="calc"),
    ]
    with pytest.raises(ConfigError) as err:
        build_tools(specs)
    text = str(err.value)
    assert "rl.tools[0].function = 'zerofit_user_tools:untyped'" in text and "'untyped'" in text
    assert "missing a type hint" in text and "no docstring" in text
    assert "rl.tools[2].function = 'calc' is not a tool zerofit knows" in text
    with pytest.raises(ConfigError, match="no module 'zerofit_absent_tools'"):
        build_tools([ToolSpec(function="zerofit_absent_tools:f")])
    with pytest.raises(ConfigError, match="two tools are named calculator"):
        build_tools([ToolSpec(function="calculator"), ToolSpec(function="calculator")])


def test_the_fallback_renders_the_tools_in_the_system_turn_and_replies_as_user_turns() -> None:
    tok = build_tokenizer()  # tiny-llama: a template without a tools section
    schemas, _ = build_tools([ToolSpec(function="calculator")])
    chat = AgentChat(tok, schemas, [tok.eos_token_id])
    assert (chat.format, chat.native) == ("hermes", False)
    question = [{"role": "user", "content": "What is 2+3?"}]
    start = tok.decode(chat.start(question, "here"))
    assert start.startswith("<s>s: You may call one or more functions") and '"name": "calculator"' in start
    assert start.endswith("u: What is 2+3?\na: ")
    reply = {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    after = chat.after_turn(question, [reply], True, "here")
    assert (
        tok.decode(after) == "u: <tool_response>\n5\n</tool_response>\na: "
    )  # the sampled eos is not repeated
    assert tok.decode(chat.after_turn(question, [reply], False, "here")).startswith("</s>u: ")


@pytest.mark.parametrize(
    ("model", "fmt", "reply_turn"),
    [("tiny-qwen2", "hermes", "<tool_response>\n5\n</tool_response>"), ("tiny-llama3", "llama3", "ipython")],
)
def test_a_template_with_a_tools_section_renders_them_itself(model: str, fmt: str, reply_turn: str) -> None:
    """Qwen2.5's and Llama 3.1's real templates get the schemas through `tools=` and the replies as tool
    messages; the turn end the policy sampled is not repeated."""
    from zerofit.objectives.grpo.tool_calls import tool_reply

    tok = build_tokenizer(model)
    schemas, _ = build_tools([ToolSpec(function="calculator")])
    chat = AgentChat(tok, schemas, [tok.eos_token_id])
    assert (chat.format, chat.native) == (fmt, True)
    question = [{"role": "user", "content": "What is 2+3?"}]
    start = tok.decode(chat.start(question, "here"))
    assert '"name": "calculator"' in start and "You may call one or more functions" not in start[:40]
    after = tok.decode(chat.after_turn(question, [tool_reply("calculator", "5", True, 1)], True, "here"))
    assert reply_turn in after and not after.startswith(tok.eos_token)
