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
`zerofit.loop.environment.Environment`; its rewards are summed into the completion's reward as the reward
`environment`. Its every call is checked (`CheckedEnvironment`): one that raises or breaks the protocol, a
first prompt longer than `rl.max_prompt_length`, or a conversation the chat template refuses, fails its
trajectory (`failure`: the paragraph the rollout then agrees on across ranks, `Rollouts.agreed_score`, so
the run stops with it once). A trajectory that fails before its first turn still samples that turn (then is
dropped), so every rank runs the first forward (FSDP2 gathers the layers there), and a rank stops sampling
after the turn in which one of its trajectories failed.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from zerofit.core.errors import ZerofitError
from zerofit.core.progress import Progress
from zerofit.data.agent_chat import AgentChat
from zerofit.loop.environment import CheckedEnvironment, EnvironmentFailed, first_prompt_too_long
from zerofit.objectives.grpo.tool_calls import parse_calls, tool_reply
from zerofit.objectives.grpo.tools import ERROR_KINDS, BoundTool, ToolResult, run_call
from zerofit.strategies.base import Strategy

__all__ = ["AGENT_FIELDS", "Agent", "agent_metrics", "sample_trajectories", "turn_seed"]

# The per-trajectory figures summed over the global batch (`Agent.stats`), in the order of its table.
# cut: stopped by the token budget or rl.max_turns (not by a turn without calls); sampled: the policy's tokens.
AGENT_FIELDS = ("turns", "tool_calls", *(f"tool_errors/{k}" for k in ERROR_KINDS), "cut", "sampled", "tool_s")


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
    failure: str | None = None  # why it failed (module docstring): the run stops with this paragraph


@dataclass
class Agent:
    """The run's tools, environment class and chat template, and the turn loop over them."""

    chat: AgentChat
    tool_makers: Sequence[Callable[[dict[str, Any]], BoundTool]]
    environment: CheckedEnvironment | None
    max_turns: int
    timeout_s: float
    decode: Callable[[list[int]], str]  # special tokens skipped: what rewards and environments read
    decode_raw: Callable[[list[int]], str]  # special tokens kept: what the call parser reads
    starts: dict[int, list[int]] = field(default_factory=dict)  # record -> first prompt (no environment)
    max_prompt_length: int | None = None  # a first prompt rendered here is checked against it (None: not)

    def begin(self, row: Any, env_seed: int, where: str) -> _Track:
        """A trajectory of prompt `row`: its first messages (and the environment's), rendered with the tools;
        one that fails (module docstring) starts from the row's own prompt ids, to be sampled once."""
        messages, env, start, failure = list(row.messages), None, self.starts.get(row.record), None
        try:
            if self.environment is not None:
                env, more = self.environment.begin(dict(row.columns), env_seed, where)
                messages, start = messages + more, None
            if start is None:
                start = self.chat.start(messages, where)
                limit = self.max_prompt_length
                if limit is not None and len(start) > limit:
                    failure = first_prompt_too_long(where, len(start), limit, self.environment is not None)
        except ZerofitError as exc:  # EnvironmentFailed, or the template refused the messages (DataError)
            failure = str(exc)
        tools = {t.name: t for t in (make(row.columns) for make in self.tool_makers)}
        prompt = list(row.input_ids) if failure is not None or start is None else start
        return _Track(prompt, messages, tools, env, where, failure=failure)

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

    def _stepped(self, track: _Track) -> tuple[list[dict[str, Any]], bool] | None:
        """The environment's step on the track's last turn: (its messages, done), its reward added; None when
        it failed (the track's `failure` set, the trajectory done)."""
        assert self.environment is not None
        where = f"{track.where}, turn {track.stats['turns']}"
        try:
            messages, reward, done = self.environment.step(track.env, track.text, where)
        except EnvironmentFailed as exc:
            track.failure, track.done = str(exc), True
            return None
        track.env_reward += reward
        return messages, done

    def advance(self, track: _Track, ids: list[int], truncated: bool, entropy: float, budget: int) -> None:
        """Take one sampled turn into `track`: run its calls / the environment, append what follows."""
        if track.failure is not None:  # failed before its first turn, sampled only for the first forward
            track.done = True
            return
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
                self._stepped(track)
            track.stats["cut"] += 1
            track.truncated = track.done = True
            return
        new = self._run(track, self.decode_raw(ids))
        done = not new
        if track.env is not None:
            stepped = self._stepped(track)
            if stepped is None:
                return
            new, done = new + stepped[0], stepped[1]
        if done:
            track.done = True
            return
        if track.stats["turns"] >= self.max_turns:
            track.stats["cut"] += 1
            track.done = True
            return
        try:
            more = self.chat.after_turn(history, new, True, track.where)
        except ZerofitError as exc:  # the template refused the environment's messages (DataError)
            track.failure, track.done = str(exc), True
            return
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
    tracks = [
        agent.begin(row, turn_seed(seed, step, c, -1), f"the rollout of step {step + 1}, {_record(row, c)}")
        for row, c in zip(rows, indices, strict=True)
    ]
    budget = settings.max_new_tokens
    for turn in range(agent.max_turns):
        if turn and any(t.failure is not None for t in tracks):  # the run stops at this step (module doc)
            break
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


def _record(row: Any, index: int) -> str:
    """Where a trajectory is, in a paragraph: its data record (1-based) and global completion index."""
    return f"data record {row.record + 1} (completion {index})"


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
        "failure": t.failure,
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
