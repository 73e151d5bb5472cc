"""A built-in tiny model taught to call tools, for the agentic GRPO tests (a random-init model never writes a
tool call, so its rollouts would be one turn each).

`tool_caller()` fine-tunes tiny-llama for a few hundred plain PyTorch steps on conversations rendered exactly
as the rollouts render them (`zerofit.data.agent_chat.AgentChat`), under `TEMPLATE`: a compact chat template
with a tools section (the tools' names only, so prompts stay short) and Hermes `<tool_call>` calls. Taught:
turn 1 looks up `a` in the row's table, turn 2 calls the calculator, turn 3 answers. Sampling at temperature
1 then gives a mix of valid calls, malformed ones and plain answers: every path of the turn loop. Built once
per machine (deterministic, seeded) under the zerofit cache, keyed by `VERSION`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from zerofit.config.schema import ToolSpec
from zerofit.core.cache_dirs import cache_root
from zerofit.data.agent_chat import AgentChat
from zerofit.models.tiny import ensure_tiny_model
from zerofit.recipe.tools import build_tools

VERSION = 2  # bump when what `_build` writes changes
LR = 1e-2
TOOLS = [{"function": "calculator"}, {"function": "lookup", "column": "facts"}]
TEMPLATE = (
    "{#- calls: <tool_call>{json}</tool_call> -#}"
    "{{- bos_token -}}"
    "{%- if tools -%}{{- 'tools:' -}}{%- for t in tools -%}{{- ' ' + t.function.name -}}{%- endfor -%}"
    "{{- '\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- 'a: ' + m.content + eos_token -}}"
    "{%- elif m.role == 'tool' -%}{{- 't: ' + m.content + '\\n' -}}"
    "{%- else -%}{{- m.role[0] + ': ' + m.content + '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'a: ' -}}{%- endif -%}"
)


def problems(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` prompt rows: a product to compute, its answer, and a table for the lookup tool."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(2, 10), rng.randrange(2, 10)
        rows.append({"prompt": f"a*{b}?", "answer": str(a * b), "facts": {"a": str(a)}})
    return rows


def _call(name: str, arguments: dict[str, str]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _example(tok: Any, chat: AgentChat, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """ids and labels (-100 outside the assistant's turns) of one solved conversation."""
    a, b = row["facts"]["a"], row["prompt"][2:-1]
    turns = [_call("lookup", {"key": "a"}), _call("calculator", {"expression": f"{a}*{b}"}), row["answer"]]
    replies = [a, row["answer"]]
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    ids = chat.start(messages, "example")
    labels = [-100] * len(ids)
    for k, text in enumerate(turns):
        own = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, labels = ids + own, labels + own
        if k < len(replies):
            reply = {"role": "tool", "name": "x", "content": replies[k], "tool_call_id": "call00001"}
            after = chat.after_turn(messages, [reply], True, "example")
            messages += [{"role": "assistant", "content": text}, reply]
            ids, labels = ids + after, labels + [-100] * len(after)
    return ids, labels


def _build(folder: Path, steps: int, seed: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = ensure_tiny_model("tiny-llama")
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = TEMPLATE
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    schemas, _ = build_tools([ToolSpec(**t) for t in TOOLS])
    chat = AgentChat(tok, schemas, [tok.eos_token_id])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # tiny matrices: one thread is as fast, and leaves the other cores to the launches
    for step in range(steps):
        pairs = [_example(tok, chat, row) for row in problems(8, seed * 100_000 + step)]
        width = max(len(ids) for ids, _ in pairs)
        ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in pairs])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
        mask = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in pairs])[:, None]).long()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = LR * (1 - step / steps)  # decayed to 0: a stable end point
        optimizer.step()
        optimizer.zero_grad()
    torch.set_num_threads(threads)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def tool_caller(steps: int = 200, seed: int = 0) -> Path:
    """The taught model's folder (built now unless the cache has it; written atomically)."""
    folder = cache_root() / f"test-tool-caller-v{VERSION}-s{steps}-seed{seed}"
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    _build(staging, steps, seed)
    try:
        os.rename(staging, folder)
    except OSError:  # another process built it first
        shutil.rmtree(staging, ignore_errors=True)
    return folder
