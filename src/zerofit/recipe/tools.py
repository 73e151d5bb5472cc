"""`rl.tools` and `rl.environment` -> the run's multi-turn `Agent` (`zerofit.loop.turns`), built at launch.

A built-in tool is named by itself (`zerofit.objectives.grpo.tools.BUILTIN_TOOLS`); the user's own as
`module:function`, and an environment as `module:Class`, imported with importlib (`zerofit.recipe.user_code`)
only by a launch, from the config the user launched with; `zerofit plan`, `export`, `generate` and `compare`
of a run folder never call `build_agent`. Each tool's JSON schema is built here, from its signature and
docstring: a tool whose schema cannot be built is refused with one paragraph naming the function and what
is missing, before the run starts. Every record's first prompt is rendered now and refused when longer than
`rl.max_prompt_length`; with an environment, after the messages its `reset` gives (so a reset that fails on a
record fails here, before the run's files are written). Each rank builds its own agent; whatever one refuses,
every rank raises and rank 0 says (`zerofit.recipe.assembly.PreparedRun.rollouts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from zerofit.config.schema import RLSection, ToolSpec
from zerofit.core.errors import ConfigError, DataError
from zerofit.data.agent_chat import AgentChat
from zerofit.loop.environment import CheckedEnvironment, first_prompt_too_long
from zerofit.loop.turns import Agent, turn_seed
from zerofit.objectives.grpo.rewards import _IMPORT_FORM
from zerofit.objectives.grpo.tools import BUILTIN_TOOLS, BoundTool, lookup_in, tool_schema
from zerofit.recipe.user_code import import_user_object

__all__ = ["build_agent", "build_tools"]

Maker = Callable[[dict[str, Any]], BoundTool]


def _function(i: int, spec: ToolSpec) -> tuple[Callable[..., Any], bool] | str:
    """The tool's function and whether it reads the row (a built-in lookup), or why it cannot be one."""
    where = f"rl.tools[{i}].function = {spec.function!r}"
    if spec.function in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec.function]
    if not _IMPORT_FORM.match(spec.function):
        return (
            f"{where} is not a tool zerofit knows; use a built-in ({', '.join(BUILTIN_TOOLS)}) or your own "
            "function as `module:function` (e.g. my_tools:weather for my_tools.py on PYTHONPATH)"
        )
    return import_user_object(where, spec.function), False


def _maker(fn: Callable[..., Any], reads_row: bool, schema: dict[str, Any], column: str) -> Maker:
    """The tool bound to a row: a lookup reads its table from the row's `column`."""
    name, parameters = schema["function"]["name"], schema["function"].get("parameters", {})
    if reads_row:
        return lambda row: BoundTool(name, lookup_in(row.get(column)), parameters)
    tool = BoundTool(name, fn, parameters)
    return lambda row: tool


def build_tools(specs: list[ToolSpec]) -> tuple[list[dict[str, Any]], list[Maker]]:
    """The tools' JSON schemas (what the template shows the model) and their makers, in `rl.tools` order;
    ConfigError (one paragraph per problem) for an unknown name, an import that fails, a schema that cannot be
    built, or two tools of one name."""
    problems: list[str] = []
    schemas, makers = [], []
    for i, spec in enumerate(specs):
        found = _function(i, spec)
        if isinstance(found, str):
            problems.append(found)
            continue
        fn, reads_row = found
        try:
            schema = tool_schema(fn)
        except Exception as exc:
            problems.append(
                f"rl.tools[{i}].function = {spec.function!r}: the JSON schema of function "
                f"{getattr(fn, '__qualname__', fn)!r} cannot be built ({exc}); give every argument a type hint "
                "and the function a Google-style docstring: a description, then `Args:` with a line per argument"
            )
            continue
        schemas.append(schema)
        makers.append(_maker(fn, reads_row, schema, spec.column))
    names = [s["function"]["name"] for s in schemas]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        problems.append(
            f"rl.tools: two tools are named {', '.join(twice)}; a call names its tool, so list each once"
        )
    if problems:
        raise ConfigError(problems)
    return schemas, makers


def _environment(name: str | None) -> CheckedEnvironment | None:
    """The class `rl.environment` names, imported now (None: no environment)."""
    if name is None:
        return None
    where = f"rl.environment = {name!r}"
    if not _IMPORT_FORM.match(name):
        raise ConfigError([f"{where}: name your environment class as `module:Class` (e.g. my_env:Guess)"])
    return CheckedEnvironment(import_user_object(where, name, "class"))


def first_prompts(
    chat: AgentChat,
    prompts: Sequence[Any],
    limit: int,
    environment: CheckedEnvironment | None = None,
    seed: int = 0,
) -> dict[int, list[int]]:
    """Each record's first prompt rendered with the tools (the rollouts reuse them when there is no
    environment); DataError when one is longer than `rl.max_prompt_length` (the tools' schemas are part of
    it). With an `environment`, a new instance's `reset` of each record comes first, with a launch seed of
    its own (`turn_seed(seed, -1, record, -1)`; the rollouts check each trajectory's again, at its own
    seed); a reset that fails raises its `EnvironmentFailed`."""
    starts = {}
    for p in prompts:
        where = f"data record {p.record + 1}"
        messages = list(p.messages)
        if environment is not None:
            reset_seed = turn_seed(seed, -1, p.record, -1)
            messages += environment.begin(dict(p.columns), reset_seed, f"{where} (checked at launch)")[1]
        ids = chat.start(messages, where)
        if len(ids) > limit:
            raise DataError(first_prompt_too_long(where, len(ids), limit, environment is not None))
        starts[p.record] = ids
    return starts


def build_agent(
    rl: RLSection,
    tokenizer: Any,
    end_ids: tuple[int, ...],
    decode: Callable[[list[int]], str],
    prompts: Sequence[Any],
    seed: int,
) -> Agent | None:
    """The run's `Agent` when `rl.tools` or `rl.environment` is set (None: single-turn rollouts); each
    record's first prompt is rendered (and its length checked) now, with an environment after its reset."""
    if not rl.tools and rl.environment is None:
        return None
    schemas, makers = build_tools(rl.tools)
    chat = AgentChat(tokenizer, schemas, end_ids)
    environment = _environment(rl.environment)
    starts = first_prompts(chat, prompts, rl.max_prompt_length, environment, seed)
    return Agent(
        chat=chat,
        starts={} if environment is not None else starts,
        max_prompt_length=rl.max_prompt_length,
        tool_makers=makers,
        environment=environment,
        max_turns=rl.max_turns,
        timeout_s=rl.tool_timeout_s,
        decode=decode,
        decode_raw=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
