"""Multi-turn rollouts: the policy samples a turn, its tool calls run (or an environment answers), the replies
go back through the chat template, and the policy samples the next turn (`rl.tools`, `rl.environment`).

Per completion, until a turn calls no tool (or the environment says done), `rl.max_turns` turns were sampled,
or the trajectory's token budget (`rl.max_completion_length`: every token after the first prompt, sampled
or not) is spent:

    1. the turn is sampled by `zerofit.loop.rollout.sample_completions` from the conversation so far, its
       generator seeded by (seed, step, global completion index, turn) (`turn_seed`), at most the budget left;
    2. its calls are parsed in the template's format and run (`zerofit.objectives.grpo.tool_calls`, `.tools`:
       an error of any kind becomes the reply, counted); an environment steps on the turn's text;
    3. the tokens that follow the turn (replies, next generation prompt) come from the template
       (`zerofit.data.agent_chat.AgentChat.after_turn`) and carry no loss: `Sampled.trained` marks only the
       policy's own tokens.

A turn's tokens depend only on its completion's conversation and generator, and tools and environments see
only that completion's row, text and seed, so a step's trajectories are the same tokens whatever the split
and a resumed run samples what the uninterrupted one did (a tool that answers by wall-clock, such as a
timeout, is the one exception: it is said in the guide). Rows of one turn are sampled together; rows with
different budgets left go in separate batches (a row's tokens never depend on its batch).

An environment (`rl.environment: module:Class`) is built once per completion with no arguments and follows
`Environment`; its rewards are summed into the completion's reward as the reward `environment`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from zerofit.core.progress import Progress
from zerofit.data.agent_chat import AgentChat
from zerofit.objectives.grpo.tool_calls import parse_calls, tool_reply
from zerofit.objectives.grpo.tools import ERROR_KINDS, BoundTool, ToolResult, run_call
from zerofit.strategies.base import Strategy

__all__ = ["AGENT_FIELDS", "Agent", "Environment", "agent_metrics", "sample_trajectories", "turn_seed"]

# The per-trajectory figures summed over the global batch (`Agent.stats`), in the order of its table.
# cut: stopped by the token budget or rl.max_turns (not by a turn without calls); sampled: the policy's tokens.
AGENT_FIELDS = ("turns", "tool_calls", *(f"tool_errors/{k}" for k in ERROR_KINDS), "cut", "sampled", "tool_s")


class Environment(Protocol):
    """What `rl.environment: module:Class` names: one instance per completion, built with no arguments."""

    def reset(self, row: dict[str, Any], seed: int) -> list[dict[str, Any]]:
        """The messages that follow the row's prompt (may be none), from the row's columns and a seed."""
        ...

    def step(self, text: str) -> tuple[list[dict[str, Any]], float, bool]:
        """The assistant's turn text -> the next messages, a reward contribution, and whether it is done."""
        ...


def turn_seed(seed: int, step: int, index: int, turn: int) -> int:
    """The sampling seed of turn `turn` of global completion `index` at step `step` (64 bits of a hash)."""
    digest = hashlib.sha256(f"zerofit-agent/{seed}/{step}/{index}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class _Track:
    """One trajectory while it is sampled."""

    prompt: list[int]
    messages: list[dict[str, Any]]
    tools: dict[str, BoundTool]
    env: Any
    where: str
    ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    entropy: float = 0.0
    text: str = ""
    truncated: bool = False
    done: bool = False
    env_reward: float = 0.0
    stats: Counter[str] = field(default_factory=Counter)


@dataclass
class Agent:
    """The run's tools, environment class and chat template, and the turn loop over them."""

    chat: AgentChat
    tool_makers: Sequence[Callable[[dict[str, Any]], BoundTool]]
    environment: Callable[[], Any] | None
    max_turns: int
    timeout_s: float
    decode: Callable[[list[int]], str]  # special tokens skipped: what rewards and environments read
    decode_raw: Callable[[list[int]], str]  # special tokens kept: what the call parser reads
    starts: dict[int, list[int]] = field(default_factory=dict)  # record -> first prompt (no environment)

    def begin(self, row: Any, env_seed: int) -> _Track:
        """A trajectory of prompt `row`: its first messages (and the environment's), rendered with the tools."""
        where = f"rl rollout of data record {row.record + 1}"
        messages = list(row.messages)
        env = self.environment() if self.environment is not None else None
        if env is not None:
            messages += list(env.reset(dict(row.columns), env_seed))
        tools = {t.name: t for t in (make(row.columns) for make in self.tool_makers)}
        start = self.starts.get(row.record) if env is None else None
        return _Track(start or self.chat.start(messages, where), messages, tools, env, where)

    def _run(self, track: _Track, text: str) -> list[dict[str, Any]]:
        """The replies to the turn's calls (each counted, errors by kind)."""
        replies = []
        for call in parse_calls(text, self.chat.format) if track.tools else []:
            if call.malformed is not None:
                result = ToolResult(f"Error: malformed tool call ({call.malformed})", "malformed", 0.0)
            else:
                result = run_call(track.tools, call.name, call.arguments, self.timeout_s)
            track.stats["tool_calls"] += 1
            track.stats["tool_s"] += result.seconds
            if result.error is not None:
                track.stats[f"tool_errors/{result.error}"] += 1
            replies.append(
                tool_reply(call.name or "error", result.reply, self.chat.native, track.stats["tool_calls"])
            )
        return replies

    def advance(self, track: _Track, ids: list[int], truncated: bool, entropy: float, budget: int) -> None:
        """Take one sampled turn into `track`: run its calls / the environment, append what follows."""
        track.ids += ids
        track.trained += [True] * len(ids)
        track.entropy += entropy
        track.stats["turns"] += 1
        track.stats["sampled"] += len(ids)
        track.text = self.decode(ids)
        history = track.messages
        track.messages = [*history, {"role": "assistant", "content": track.text}]
        if truncated:  # the budget is spent: an environment still scores the turn, nothing follows it
            if track.env is not None:
                track.env_reward += float(track.env.step(track.text)[1])
            track.stats["cut"] += 1
            track.truncated = track.done = True
            return
        new = self._run(track, self.decode_raw(ids))
        done = not new
        if track.env is not None:
            messages, reward, finished = track.env.step(track.text)
            track.env_reward += float(reward)
            new, done = new + list(messages), bool(finished)
        if done:
            track.done = True
            return
        if track.stats["turns"] >= self.max_turns:
            track.stats["cut"] += 1
            track.done = True
            return
        more = self.chat.after_turn(history, new, True, track.where)
        if len(track.ids) + len(more) >= budget:
            track.stats["cut"] += 1
            track.truncated = track.done = True
            return
        track.ids += more
        track.trained += [False] * len(more)
        track.messages += new


def sample_trajectories(
    agent: Agent,
    sample: Callable[..., list[Any]],
    rows: Sequence[Any],
    indices: Sequence[int],
    seed: int,
    step: int,
    settings: Any,
    shown: Progress | None = None,
) -> list[dict[str, Any]]:
    """This rank's trajectories of global completions `indices` (prompts `rows`) at step `step`, each as the
    fields of a `zerofit.loop.rollout.Sampled`; `sample(prompts, seeds, settings, shown)` samples one turn."""
    # the environment's seed: the trajectory's own, apart from its turns' (turn -1)
    tracks = [agent.begin(row, turn_seed(seed, step, c, -1)) for row, c in zip(rows, indices, strict=True)]
    budget = settings.max_new_tokens
    for turn in range(agent.max_turns):
        live = [i for i, t in enumerate(tracks) if not t.done]
        groups: dict[int, list[int]] = {}
        for i in live:
            groups.setdefault(budget - len(tracks[i].ids), []).append(i)
        for left, members in sorted(groups.items()):
            prompts = [tracks[i].prompt + tracks[i].ids for i in members]
            seeds = [turn_seed(seed, step, indices[i], turn) for i in members]
            for i, s in zip(
                members, sample(prompts, seeds, replace(settings, max_new_tokens=left), shown), strict=True
            ):
                agent.advance(tracks[i], s.ids, s.truncated, s.entropy_sum, budget)
    return [_fields(t) for t in tracks]


def _fields(t: _Track) -> dict[str, Any]:
    """A finished trajectory as `Sampled`'s fields."""
    stats = [float(t.stats[name]) for name in AGENT_FIELDS]
    return {
        "ids": t.ids,
        "truncated": t.truncated,
        "entropy_sum": t.entropy,
        "trained": t.trained,
        "prompt_ids": t.prompt,
        "text": t.text,
        "messages": t.messages,
        "env_reward": t.env_reward,
        "stats": torch.tensor(stats, dtype=torch.float64),
    }


def agent_metrics(
    strategy: Strategy, flat: list[int], sampled: Sequence[Any], total: int
) -> dict[str, float]:
    """The step's multi-turn fields of metrics.jsonl, over the global batch (one all-reduce of every
    trajectory's `AGENT_FIELDS`): turns and tool calls per trajectory, errors per trajectory by kind, the
    share of trajectories cut by the token budget or rl.max_turns, sampled vs masked tokens, time in tools
    (summed over ranks)."""
    local = torch.zeros(len(AGENT_FIELDS) + 1, total, dtype=torch.float64)
    index = torch.tensor(flat, dtype=torch.long)
    local[:-1, index] = torch.stack([s.stats for s in sampled], dim=1)
    local[-1, index] = torch.tensor([float(len(s.ids)) for s in sampled], dtype=torch.float64)
    table = strategy.all_reduce_sum(local.to(strategy.device)).cpu()
    row = dict(zip(AGENT_FIELDS, table[:-1], strict=True))
    sampled_tokens = float(row["sampled"].sum())
    return {
        "agent/turns": float(row["turns"].mean()),
        "agent/tool_calls": float(row["tool_calls"].mean()),
        "agent/tool_errors": float(sum(row[f"tool_errors/{k}"] for k in ERROR_KINDS).mean()),
        **{f"agent/tool_errors/{k}": float(row[f"tool_errors/{k}"].mean()) for k in ERROR_KINDS},
        "agent/truncated_fraction": float((row["cut"] > 0).double().mean()),
        "agent/sampled_tokens": sampled_tokens,
        "agent/masked_tokens": float(table[-1].sum()) - sampled_tokens,
        "time/tools_s": float(row["tool_s"].sum()),
    }
