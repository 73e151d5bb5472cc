"""The multi-turn loop (`zerofit.loop.turns`) on the tiny model's real tokenizer and template (the fallback:
no tools section), with the policy's turns scripted: calls run and their replies follow through the template,
masked; the loop stops at a turn without calls, at rl.max_turns or at the token budget; each turn has its own
seed; the micro-batch trains only the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerofit.config.schema import ToolSpec
from zerofit.data.agent_chat import AgentChat
from zerofit.loop.rollout import Sampled, SamplingSettings, micro_batch
from zerofit.loop.turns import AGENT_FIELDS, Agent, sample_trajectories, turn_seed
from zerofit.models.tiny import build_tokenizer
from zerofit.recipe.tools import build_tools
from zerofit.token_loss.sums import IGNORE_INDEX

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@dataclass
class Row:
    messages: list[dict[str, Any]]
    columns: dict[str, Any] = field(default_factory=dict)
    record: int = 0


def _agent(max_turns: int) -> tuple[Agent, Any]:
    tok = build_tokenizer()
    schemas, makers = build_tools([ToolSpec(function="calculator")])
    chat = AgentChat(tok, schemas, [tok.eos_token_id])
    agent = Agent(
        chat=chat,
        tool_makers=makers,
        environment=None,
        max_turns=max_turns,
        timeout_s=5.0,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        decode_raw=lambda ids: tok.decode(ids),
    )
    return agent, tok


def _scripted(tok: Any, turns: list[str], seen: list[tuple[list[int], int]]) -> Any:
    """A policy that writes `turns` in order (eos-ended), recording each call's prompts and seeds."""

    def sample(prompts: list[list[int]], seeds: list[int], s: SamplingSettings, shown: Any) -> list[Sampled]:
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            seen.append((prompt, seed))
            ids = tok(turns[len(seen) - 1], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append(Sampled(ids[: s.max_new_tokens], len(ids) > s.max_new_tokens, 0.0))
        return out

    return sample


def _run(
    turns: list[str], max_turns: int, budget: int
) -> tuple[dict[str, Any], list[tuple[list[int], int]], Any]:
    agent, tok = _agent(max_turns)
    seen: list[tuple[list[int], int]] = []
    settings = SamplingSettings(max_new_tokens=budget, eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    rows = [Row([{"role": "user", "content": "6*7?"}])]
    [traj] = sample_trajectories(agent, _scripted(tok, turns, seen), rows, [5], 9, 2, settings)
    return traj, seen, tok


def test_a_call_its_reply_then_the_answer() -> None:
    traj, seen, tok = _run([CALL, "42"], max_turns=3, budget=400)
    stats = dict(zip(AGENT_FIELDS, traj["stats"].tolist(), strict=True))
    assert stats["turns"] == 2 and stats["tool_calls"] == 1 and stats["cut"] == 0
    assert [seed for _, seed in seen] == [turn_seed(9, 2, 5, 0), turn_seed(9, 2, 5, 1)]
    text = tok.decode(traj["ids"])
    assert text == CALL + "</s>u: <tool_response>\n42\n</tool_response>\na: 42</s>"
    assert seen[1][0] == traj["prompt_ids"] + traj["ids"][: len(traj["ids"]) - 3]  # turn 2 sees the reply
    assert traj["text"] == "42" and [m["role"] for m in traj["messages"]] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    own = [tok.decode([i]) for i, t in zip(traj["ids"], traj["trained"], strict=True) if t]
    assert "".join(own) == CALL + "</s>42</s>"  # only the policy's tokens are trained
    batch = micro_batch(
        [traj["prompt_ids"]], [traj["ids"]], [True], torch.zeros(1), tok.pad_token_id, [traj["trained"]]
    )
    labelled = batch["labels"][0][batch["labels"][0] != IGNORE_INDEX].tolist()
    assert tok.decode(labelled) == CALL + "</s>42</s>"
    assert int(batch["attention_mask"].sum()) == len(traj["prompt_ids"]) + len(
        traj["ids"]
    )  # replies attended


def test_errors_are_replies_and_the_limits_stop_the_loop() -> None:
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "x"}}</tool_call>'
    traj, _, tok = _run(["<tool_call>{oops</tool_call>", bad, CALL], max_turns=3, budget=600)
    stats = dict(zip(AGENT_FIELDS, traj["stats"].tolist(), strict=True))
    assert stats["tool_errors/malformed"] == 1 and stats["tool_errors/raised"] == 1
    assert stats["turns"] == 3 and stats["cut"] == 1  # the third turn still calls: rl.max_turns stops it
    assert "Error: malformed tool call" in tok.decode(traj["ids"])
    short, _, _ = _run([CALL, "42"], max_turns=3, budget=len(CALL) + 10)  # no room for the reply
    assert short["truncated"] and dict(zip(AGENT_FIELDS, short["stats"].tolist(), strict=True))["turns"] == 1
