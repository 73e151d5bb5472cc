"""The multi-turn loop (`zerofit.loop.turns`) on the tiny model's real tokenizer and template (the fallback:
no tools section), with the policy's turns scripted: calls run and their replies follow through the template,
masked; the loop stops at a turn without calls, at rl.max_turns or at the token budget; each turn has its own
seed; the micro-batch trains only the sampled tokens; an environment that raises or breaks its protocol fails
its trajectory with one paragraph (the run then stops with it, `Rollouts.agreed_score`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from zerofit.config.schema import ToolSpec
from zerofit.core.errors import DataError
from zerofit.data.agent_chat import AgentChat
from zerofit.loop.environment import CheckedEnvironment
from zerofit.loop.rollout import Sampled, SamplingSettings, micro_batch
from zerofit.loop.turns import AGENT_FIELDS, Agent, sample_trajectories, turn_seed
from zerofit.models.tiny import build_tokenizer
from zerofit.recipe.tools import build_tools, first_prompts
from zerofit.token_loss.sums import IGNORE_INDEX

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@dataclass
class Row:
    messages: list[dict[str, Any]]
    columns: dict[str, Any] = field(default_factory=dict)
    record: int = 0
    input_ids: list[int] = field(default_factory=lambda: [1, 5, 6])


def _agent(max_turns: int, environment: type | None = None) -> tuple[Agent, Any]:
    tok = build_tokenizer()
    schemas, makers = build_tools([ToolSpec(function="calculator")])
    chat = AgentChat(tok, schemas, [tok.eos_token_id])
    agent = Agent(
        chat=chat,
        tool_makers=makers,
        environment=None if environment is None else CheckedEnvironment(environment),
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


class _Env:
    """An environment whose reset and step return what the test sets, or raise it."""

    reset_gives: Any = ()
    step_gives: Any = ([{"role": "user", "content": "more"}], 0.5, False)

    def reset(self, row: dict[str, Any], seed: int) -> Any:
        return _give(self.reset_gives)

    def step(self, text: str) -> Any:
        return _give(self.step_gives)


def _give(value: Any) -> Any:
    if isinstance(value, Exception):
        raise value
    return list(value) if value == () else value


WHERE = "on the rollout of step 3, data record 1 (completion 5)"
BROKEN = [
    ("reset_gives", ValueError("no board"), f"in reset() {WHERE}: it raised ValueError: no board"),
    ("step_gives", KeyError("move"), f"in step() {WHERE}, turn 1: it raised KeyError: 'move'"),
    ("reset_gives", "hello", "in reset() " + WHERE + ": it returned 'hello' (a str, not a list), and reset"),
    (
        "step_gives",
        ([], float("nan"), True),
        "(its reward nan is not a finite int or float), and step must return",
    ),
    ("step_gives", ([{"role": "user"}], 1.0, True), "(item 0 has no string 'content'), and step must"),
    ("step_gives", ([], 1.0, "yes"), "(its done 'yes' is a str)"),
    ("step_gives", ([], 1.0), "it returned ([], 1.0), and step must return a tuple (messages, reward, done)"),
]


@pytest.mark.parametrize(("method", "gives", "said"), BROKEN)
def test_an_environment_that_raises_or_breaks_its_protocol_fails_its_trajectory(
    method: str, gives: Any, said: str
) -> None:
    """The paragraph names the class, the method, the step, record, completion (and turn) and the exception
    or the bad value, and says the fix; a trajectory that failed in reset still samples its first turn (every
    rank's first forward) from the row's own prompt, then stops; one that failed in step samples no more."""
    environment = type("Broken", (_Env,), {method: gives})
    agent, tok = _agent(3, environment)
    seen: list[tuple[list[int], int]] = []
    settings = SamplingSettings(max_new_tokens=400, eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    rows = [Row([{"role": "user", "content": "6*7?"}])]
    [traj] = sample_trajectories(agent, _scripted(tok, ["1", "2", "3"], seen), rows, [5], 9, 2, settings)
    name = f"{__name__}:Broken"
    assert traj["failure"].startswith(f"The environment {name} failed "), traj["failure"]
    assert said in traj["failure"], traj["failure"]
    assert traj["failure"].endswith(
        "answer a turn it cannot use with messages and a low reward rather than an exception."
    )
    assert len(seen) == 1  # the first turn only
    if method == "reset_gives":
        assert seen[0][0] == rows[0].input_ids and traj["ids"] == []


def test_a_first_prompt_over_the_limit_is_refused_at_launch_with_the_keys() -> None:
    """Every record's first prompt is rendered at launch; with an environment, after its reset's messages
    (a reset that raises there names the record); one over rl.max_prompt_length names the record, its length,
    the limit and the keys to change, the same paragraph for a tools-only run and an environment's."""
    tok = build_tokenizer()
    schemas, _ = build_tools([ToolSpec(function="calculator")])
    chat = AgentChat(tok, schemas, [tok.eos_token_id])
    rows = [Row([{"role": "user", "content": "6*7?"}], record=r) for r in range(2)]
    plain = first_prompts(chat, rows, 10_000)
    limit = len(plain[1])
    assert first_prompts(chat, rows, limit) == plain  # fits exactly
    long = type("Long", (_Env,), {"reset_gives": [{"role": "user", "content": "a long board " * 20}]})
    with pytest.raises(DataError) as err:
        first_prompts(chat, rows, limit, CheckedEnvironment(long), seed=1)
    grown = len(chat.start([*rows[0].messages, *long.reset_gives], "x"))
    assert str(err.value) == (
        f"data record 1: its prompt with the messages rl.environment's reset gave and the tools' schemas "
        f"(rl.tools, rendered by the chat template) is {grown:,} tokens, more than rl.max_prompt_length = "
        f"{limit:,}; raise rl.max_prompt_length to at least that, shorten what reset returns, or offer fewer tools."
    )
    with pytest.raises(
        DataError,
        match=rf"data record 1: its prompt with the tools' schemas .* more than rl\."
        rf"max_prompt_length = {limit - 1}; .* or offer fewer tools\.$",
    ):
        first_prompts(chat, rows, limit - 1)
    broken = type("Broken", (_Env,), {"reset_gives": ValueError("no board")})
    with pytest.raises(
        Exception, match=r"failed in reset\(\) on data record 1 \(checked at launch\): it raised"
    ):
        first_prompts(chat, rows, limit, CheckedEnvironment(broken), seed=1)


def test_a_first_prompt_that_outgrows_the_limit_at_its_own_seed_fails_its_trajectory() -> None:
    """The launch checks each record at one seed; a reset whose messages grow with the seed is checked again
    in the rollout, with the same paragraph."""

    class Grows(_Env):
        def reset(self, row: dict[str, Any], seed: int) -> Any:
            return [{"role": "user", "content": "board " * (seed % 7 + 30)}]

    agent, tok = _agent(3, Grows)
    agent.max_prompt_length = 20
    settings = SamplingSettings(max_new_tokens=400, eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    rows = [Row([{"role": "user", "content": "6*7?"}])]
    [traj] = sample_trajectories(agent, _scripted(tok, ["1"], []), rows, [5], 9, 2, settings)
    grown = agent.chat.start([*rows[0].messages, *Grows().reset({}, turn_seed(9, 2, 5, -1))], "x")
    assert traj["failure"] == (
        f"the rollout of step 3, data record 1 (completion 5): its prompt with the messages rl.environment's "
        f"reset gave and the tools' schemas (rl.tools, rendered by the chat template) is {len(grown):,} tokens, "
        "more than rl.max_prompt_length = 20; raise rl.max_prompt_length to at least that, shorten what reset "
        "returns, or offer fewer tools."
    )
