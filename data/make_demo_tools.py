"""Write data/demo_tools.jsonl: tool-calling conversations of the demo tasks (`messages` format with `tools`).

Each conversation offers two of three tools (`add`, `reverse`, `upper`, JSON schemas in the record's `tools`);
the user asks for a task, the assistant calls the tool (sometimes two calls, one after the other), the tool's
result comes back as a `tool` message and the assistant answers with it; one in six asks nothing a tool does
and gets a plain answer. Three in four records are in the OpenAI layout (`messages`, `tool_calls` with
`arguments` as a JSON string, `tool` messages with `tool_call_id`), one in four in LLaMA-Factory's ShareGPT
layout (`conversations` with `function_call` / `observation` turns, `tools` a JSON string): zerofit reads both
into the same conversation (data/tools.py). Seeded: running it again writes the same bytes.

    python data/make_demo_tools.py [--n 48] [--seed 0] [--out data/demo_tools.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Any

_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
_NUMBERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = {
    "add": {"name": "add", "description": "Add two integers.", "parameters": _NUMBERS},
    "reverse": {"name": "reverse", "description": "Reverse a text.", "parameters": _TEXT},
    "upper": {"name": "upper", "description": "Upper-case a text.", "parameters": _TEXT},
}
CHATS = (("hi", "Hello! Ask me to add, reverse or upper-case."), ("thanks", "You are welcome."))


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))


def _task(rng: random.Random) -> tuple[str, str, dict[str, Any], str]:
    """(tool, the user's request, the call's arguments, the tool's result) of one random task."""
    tool = rng.choice(tuple(TOOLS))
    if tool == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return tool, f"add {a} and {b}", {"a": a, "b": b}, str(a + b)
    word = _word(rng)
    result = word[::-1] if tool == "reverse" else word.upper()
    return tool, f"{tool} {word}", {"text": word}, result


def _conversation(rng: random.Random, index: int) -> tuple[list[str], list[dict[str, Any]]]:
    """(tools offered, OpenAI messages) of conversation `index`."""
    if index % 6 == 5:
        question, answer = rng.choice(CHATS)
        names = rng.sample(tuple(TOOLS), 2)
        return names, [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    tasks = [_task(rng) for _ in range(1 + (index % 4 == 3))]
    names = sorted({t[0] for t in tasks})  # the tools called, and one more when only one is
    names = names if len(names) > 1 else sorted([*names, rng.choice([x for x in TOOLS if x not in names])])
    messages: list[dict[str, Any]] = [{"role": "user", "content": " then ".join(t[1] for t in tasks)}]
    for k, (tool, _, arguments, result) in enumerate(tasks):
        call_id = f"call{index:03d}{k:02d}"
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": tool, "arguments": json.dumps(arguments)},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "name": tool, "content": result})
    messages.append({"role": "assistant", "content": "The answer: " + ", ".join(t[3] for t in tasks) + "."})
    return names, messages


def _sharegpt(names: list[str], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same conversation in LLaMA-Factory's ShareGPT layout."""
    turns = []
    for m in messages:
        if m.get("tool_calls"):
            function = m["tool_calls"][0]["function"]
            call = {"name": function["name"], "arguments": json.loads(function["arguments"])}
            turns.append({"from": "function_call", "value": json.dumps(call)})
        else:
            speaker = {"user": "human", "assistant": "gpt", "tool": "observation"}[m["role"]]
            turns.append({"from": speaker, "value": m["content"]})
    return {"conversations": turns, "tools": json.dumps([TOOLS[n] for n in names])}


def make_tool_conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` records, every fourth in the ShareGPT layout (see module doc)."""
    rng = random.Random(seed)
    records = []
    for index in range(n):
        names, messages = _conversation(rng, index)
        if index % 4 == 1:
            records.append(_sharegpt(names, messages))
        else:
            tools = [{"type": "function", "function": TOOLS[name]} for name in names]
            records.append({"messages": messages, "tools": tools})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=48, help="number of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "demo_tools.jsonl")
    args = parser.parse_args()
    lines = [json.dumps(r) for r in make_tool_conversations(args.n, args.seed)]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} conversations to {args.out}")


if __name__ == "__main__":
    main()
