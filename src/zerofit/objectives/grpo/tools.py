"""Tools an agentic GRPO run (`rl.tools`) lets the policy call, and the one place a call runs.

A tool is a Python function with type hints and a Google-style docstring: its JSON schema comes from them
(transformers' `get_json_schema`, `tool_schema`) and reaches the model through the chat template's `tools=`.
The built-ins are safe to ship (`BUILTIN_TOOLS`):

    calculator(expression)   arithmetic (+ - * / // % **, parentheses, unary signs) on numbers, parsed from
                             Python's AST and evaluated node by node: no eval, no names, no calls;
    lookup(key)              the value under `key` in a column of the data row (`rl.tools[].column`: a
                             mapping, or a JSON object as text): a retrieval stand-in for tests and demos.

`run_call` runs one parsed call with a timeout and never raises: an unknown tool, arguments that do not
match the schema, an exception, a hang past the timeout, or a return value that is not text and cannot be
written as JSON each become the tool's reply (what the model reads next turn, so it learns from it) and a
counted error of its kind (`ERROR_KINDS`; `malformed` is the parser's: `zerofit.objectives.grpo.tool_calls`).
Torch-free; the user's own `module:function` is imported only at launch (`zerofit.recipe.tools`).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN_TOOLS",
    "ERROR_KINDS",
    "EXAMPLE_CALLS",
    "BoundTool",
    "ToolResult",
    "calculator",
    "lookup_in",
    "run_call",
    "tool_schema",
]

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "bad_return")
MAX_EXPRESSION = 200  # characters of a calculator expression
MAX_POWER = 64  # the largest exponent the calculator takes
MAX_MAGNITUDE = 1e30  # a larger intermediate result is refused (no huge integers)

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _value(node: ast.AST) -> int | float:
    """One node of an arithmetic expression, evaluated; ValueError names what is not arithmetic."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"exponent {right} is larger than {MAX_POWER}")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise ValueError("the result is out of range")
        return result
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic on numbers")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the exact result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, for example (12 + 7) * 3.
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    try:
        result = _value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(result, float):
        if not math.isfinite(result):
            raise ValueError("the result is not a finite number")
        return str(int(result)) if result.is_integer() else f"{result:.12g}"
    return str(result)


def lookup(key: str) -> str:
    """Look up a key in the table of the current problem and return its value.

    Args:
        key: The key to look up.
    """
    raise NotImplementedError("bound to a row by lookup_in")  # the schema's signature; never called


def lookup_in(table: Any) -> Callable[[str], str]:
    """`lookup` bound to one data row's table (a mapping, or a JSON object as text; anything else is empty)."""
    if isinstance(table, str):
        try:
            table = json.loads(table)
        except json.JSONDecodeError:
            table = {}
    entries = {str(k): v for k, v in table.items()} if isinstance(table, Mapping) else {}

    def bound(key: str) -> str:
        if key not in entries:
            raise KeyError(f"no entry {key!r}; the keys are {', '.join(sorted(entries)) or 'none'}")
        value = entries[key]
        return value if isinstance(value, str) else json.dumps(value)

    return bound


# name -> (the function whose signature and docstring make the schema, whether it reads a column of the row)
BUILTIN_TOOLS: dict[str, tuple[Callable[..., Any], bool]] = {
    "calculator": (calculator, False),
    "lookup": (lookup, True),
}
# name -> the arguments of the one-shot call the fallback's system turn shows (`tool_calls.fallback_system_text`)
EXAMPLE_CALLS: dict[str, dict[str, str]] = {"calculator": {"expression": "(12 + 7) * 3"}}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema from its signature and docstring (transformers' `get_json_schema`); raises
    transformers' exception, whose message says what is missing (a type hint, the docstring, an argument's
    description)."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


@dataclass(frozen=True)
class BoundTool:
    """A tool ready to call for one trajectory: its name, the function (a lookup already bound to the row)
    and its schema's parameters."""

    name: str
    fn: Callable[..., Any]
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """A call's reply (what the model reads), its error kind (None: it worked) and its wall time."""

    reply: str
    error: str | None
    seconds: float


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def arguments_problem(arguments: dict[str, Any], parameters: dict[str, Any]) -> str | None:
    """Why `arguments` do not match the schema's parameters (required, unknown, JSON types), or None."""
    props = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    unknown = [name for name in arguments if name not in props]
    if missing or unknown:
        return f"missing {missing}, unknown {unknown}; the parameters are {sorted(props)}"
    for name, value in arguments.items():
        kinds = _JSON_TYPES.get(str(props[name].get("type")), (object,))
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return f"{name!r} must be of type {props[name].get('type')}, not {type(value).__name__}"
    return None


def _call_with_timeout(fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float) -> Any:
    """fn(**arguments) in a daemon thread, TimeoutError past `timeout_s` (the thread is left to finish on its
    own: Python cannot stop it, and a daemon thread never holds the process open)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(**arguments)
        except Exception as exc:  # a tool's own failure becomes its reply
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _reply_text(value: Any) -> str | None:
    """A tool's return value as the model reads it: text as it is, else JSON; None when it is neither."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


def run_call(tools: Mapping[str, BoundTool], name: str, arguments: Any, timeout_s: float) -> ToolResult:
    """Run one parsed call (module docstring): never raises; the reply says what went wrong."""
    started = time.perf_counter()

    def result(reply: str, error: str | None) -> ToolResult:
        return ToolResult(reply, error, time.perf_counter() - started)

    tool = tools.get(name)
    if tool is None:
        return result(
            f"Error: no tool named {name!r}; the tools are {', '.join(sorted(tools))}", "unknown_tool"
        )
    problem = (
        "the arguments must be a JSON object"
        if not isinstance(arguments, dict)
        else arguments_problem(arguments, tool.parameters)
    )
    if problem is not None:
        return result(f"Error: bad arguments for {name}: {problem}", "bad_arguments")
    try:
        value = _call_with_timeout(tool.fn, arguments, timeout_s)
    except TimeoutError:
        return result(f"Error: {name} did not answer within {timeout_s:g} s", "timeout")
    except Exception as exc:
        return result(f"Error: {name} raised {type(exc).__name__}: {exc}", "raised")
    text = _reply_text(value)
    if text is None:
        return result(f"Error: {name} returned a {type(value).__name__}, not text or JSON", "bad_return")
    return result(text, None)
