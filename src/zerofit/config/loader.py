"""Read a YAML run config, apply dotted `key=value` overrides, validate into `ZerofitConfig`.

Every problem becomes one line of a single `ConfigError`: unknown keys get a did-you-mean against the
schema, bad values name the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from zerofit.config.schema import BOOL_NOT_NUMBER, TEXT_NOT_NUMBER, RuleHint, ZerofitConfig
from zerofit.core.errors import ConfigError


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no tag builds an object) that reads a number with an exponent as a number in
    every form, as YAML 1.2 does: PyYAML follows YAML 1.1, whose floats need a dot and a signed exponent, so
    `lr: 3e-3`, `1e5` and `1.0e5` would be text, which a float field refuses (`schema.TEXT_NOT_NUMBER`). A
    quoted `'3e-3'` stays text."""


_EXPONENT_NUMBER = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_NUMBER, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """A config's YAML (a file, or an override's value) as data: `yaml.safe_load` plus YAML 1.2's numbers."""
    return yaml.load(text, Loader=_ConfigLoader)


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Turn `["batch.global_batch_size=64", "lora.target_modules=[q_proj,v_proj]"]` into a nested dict.

    Values are parsed as YAML scalars/flow lists, so `64` is an int, `3e-3` a float, `true` a bool, `[a,b]`
    a list and `null` None; anything else (a quoted `'3e-3'` too) stays a string.
    """
    nested: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(
                f"override {item!r} is not of the form dotted.key=value (e.g. batch.global_batch_size=64)"
            )
            continue
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # e.g. an unbalanced bracket: keep the literal text, the schema will judge it
        if _expands_beyond_limit(value):
            problems.append(_too_big(f"override {key}=...", "value"))
            continue
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"override {item!r} conflicts with an earlier override of {part!r}")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return nested


# The most values (mapping keys and values, list items, scalars) a config may expand to. A real config holds a
# few hundred; YAML aliases (`*name`) repeat a part of the document by reference, so nested ones ("billion
# laughs") expand exponentially, and any walk of the expansion (validation, a message) would never end.
MAX_CONFIG_VALUES = 10_000


def _expands_beyond_limit(document: Any) -> bool:
    """Whether `document`, its aliases expanded, holds more than `MAX_CONFIG_VALUES` values: a walk that
    counts each reference as often as it is reached and stops at the limit, so it ends fast on any input."""
    pending, seen = [document], 0
    while pending:
        node = pending.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            return True
        if isinstance(node, dict):
            pending += [*node.keys(), *node.values()]
        elif isinstance(node, list | tuple):
            pending += node
    return False


def _too_big(where: str, what: str) -> str:
    """The refusal of a config part that expands beyond `MAX_CONFIG_VALUES` values."""
    return (
        f"{where}: this {what} expands to more than {MAX_CONFIG_VALUES} values (YAML aliases `*name` nested in "
        "one another repeat a part of the document exponentially); write the values out instead of aliasing them"
    )


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Return `base` with `update` merged in recursively (update wins; neither input is modified)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`: a nested config as the dotted keys an override names; lists stay
    values. The inverse of the nesting `parse_overrides` does; `zerofit compare` and the resume check
    compare configs key by key with it."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _schema_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model class that owns the keys at `loc` (for did-you-mean suggestions)."""
    model: type[BaseModel] = ZerofitConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


# Keys users bring from other tools (HF TrainingArguments, Lightning) that map to one zerofit key.
_PRECISION_FLAGS = {"bf16", "fp16", "fp32", "half", "amp", "mixed_precision"}


def _error_loc(err: dict[str, Any]) -> list[str]:
    loc = [str(p) for p in err["loc"]]
    # Union members add their type name to the location (e.g. `int`, `literal['auto']`); drop those.
    member = ("literal[", "constrained-")
    while loc and (loc[-1] in {"int", "float", "str", "bool", "list[str]"} or loc[-1].startswith(member)):
        loc.pop()
    return loc


# pydantic's error types for a `Field(gt=, ge=, lt=, le=)` bound that a value breaks.
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _field_at(loc: Sequence[str]) -> FieldInfo | None:
    """The schema field at dotted location `loc` (None past the schema's sections)."""
    owner = _schema_at(loc[:-1]) if loc else None
    return owner.model_fields.get(loc[-1]) if owner else None


def _number(value: float) -> str:
    """A bound as written: an int in full (`4294967295`, not `4.29497e+09`), a float short (`1e-08`)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


# How long a value echoed in a message may be: a YAML alias bomb or a pasted data file is a value too.
SHOWN_CHARS = 200
_SHORT_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12 on
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, SHOWN_CHARS, 80


def shown(value: Any) -> str:
    """`repr(value)` for a message, at most `SHOWN_CHARS` long (cut with an ellipsis), and bounded in time:
    a nested container is shown through `reprlib` (its first items, three levels deep), never walked whole."""
    text = repr(value) if isinstance(value, str | int | float | bool | None) else _SHORT_REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def _constraints(field: FieldInfo) -> list[Any]:
    """The field's bounds and `RuleHint`: its own, or those of the `Annotated` member of a union
    (`bool | Annotated[int, Field(ge=0)] | Literal["auto"]`), where pydantic keeps them in the type."""
    found = list(field.metadata)
    pending = [field.annotation]
    while pending:
        for arg in typing.get_args(pending.pop()):
            if isinstance(arg, FieldInfo):
                found += arg.metadata
            elif isinstance(arg, annotated_types.BaseMetadata | RuleHint):
                found.append(arg)
            else:
                pending.append(arg)
    return found


def _bound_rule(constraints: list[Any]) -> str:
    """The field's whole range in words: `must be > 0`, or with two bounds `must be in [0, 1)`."""
    return f"must be {_range(constraints)}"


def _range(constraints: list[Any]) -> str:
    """The field's range: `> 0`, `in [0, 1)`; empty for a field without bounds."""
    lower = next((m for m in constraints if isinstance(m, annotated_types.Gt | annotated_types.Ge)), None)
    upper = next((m for m in constraints if isinstance(m, annotated_types.Lt | annotated_types.Le)), None)
    if lower is not None and upper is not None:
        low = f"({_number(lower.gt)}" if isinstance(lower, annotated_types.Gt) else f"[{_number(lower.ge)}"
        high = f"{_number(upper.lt)})" if isinstance(upper, annotated_types.Lt) else f"{_number(upper.le)}]"
        return f"in {low}, {high}"
    bound = lower or upper
    if bound is None:
        return ""
    symbol, value = {
        annotated_types.Gt: (">", "gt"),
        annotated_types.Ge: (">=", "ge"),
        annotated_types.Lt: ("<", "lt"),
        annotated_types.Le: ("<=", "le"),
    }[type(bound)]
    return f"{symbol} {_number(getattr(bound, value))}"


def _bound_problem(err: dict[str, Any], loc: list[str]) -> str | None:
    """A broken `Field(gt=/ge=/lt=/le=)` said as the key, the value, the field's range and what its edge means.

    The value is shown as the field's type holds it (`optimizer.lr = 0.0`, not the `0` that was typed).
    """
    field = _field_at(loc)
    if field is None:
        return None
    value = err.get("input")
    # pydantic's bound (`ctx`) has the field's type: a float field's bound is a float.
    float_field = any(isinstance(bound, float) for bound in err.get("ctx", {}).values())
    if float_field and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    constraints = _constraints(field)
    hint = next((m.text for m in constraints if isinstance(m, RuleHint)), None)
    return f"{'.'.join(loc)} = {shown(value)}: {_bound_rule(constraints)}" + (f" ({hint})" if hint else "")


# pydantic's error types for a value that is no number of the field's kind (a bool, inf/nan, 4.5 for an int,
# text), and why each is refused.
_KIND_ERRORS = {
    BOOL_NOT_NUMBER: "true/false is not a number",
    TEXT_NOT_NUMBER: "a quoted string is text, not a number",
    "finite_number": "not a finite number (inf and nan are refused)",
    "int_from_float": "not a whole number",
    "int_type": "",
    "int_parsing": "",
    "float_type": "",
    "float_parsing": "",
}


def _alternatives(annotation: Any) -> list[str]:
    """The non-number values a field's type takes, as a user writes them: `auto`, `false`, `null`."""
    words: list[str] = []
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Literal:
            words += [str(a).lower() if isinstance(a, bool) else str(a) for a in typing.get_args(arg)]
        elif arg is bool:
            words += ["true", "false"]
        elif arg is type(None):
            words.append("null")
    return words


def _kind_problem(err: dict[str, Any], loc: list[str]) -> str | None:
    """A value that is no number of the field's kind, said as the key, the value, why, and what the field takes:
    `train.max_steps = True: true/false is not a number; it must be an integer > 0`."""
    field = _field_at(loc)
    if field is None:
        return None
    constraints = _constraints(field)
    integer = int in {field.annotation, *typing.get_args(field.annotation)} or any(
        typing.get_args(arg)[:1] == (int,) for arg in typing.get_args(field.annotation)
    )
    rule = " ".join(filter(None, ["an integer" if integer else "a number", _range(constraints)]))
    hint = next((m.text for m in constraints if isinstance(m, RuleHint)), None)
    others = _alternatives(field.annotation)
    if hint:
        rule += f" ({hint})"
    elif others:
        rule += f", or {' or '.join(others)}"
    default = field.default
    if err["type"] == TEXT_NOT_NUMBER:  # the user's own number is the example: written without quotes
        number = str(err.get("input"))[:SHOWN_CHARS]
        rule += f"; write it without quotes: {'.'.join(loc)}={number} (in a YAML file `{loc[-1]}: {number}`)"
    elif not hint and isinstance(default, int | float) and not isinstance(default, bool):
        rule += f"; e.g. {'.'.join(loc)}={default}"
    why = _KIND_ERRORS[err["type"]] or f"not {'an integer' if integer else 'a number'}"
    return f"{'.'.join(loc)} = {shown(err.get('input'))}: {why}; it must be {rule}"


def _format_error(err: dict[str, Any]) -> str:
    loc = _error_loc(err)
    if err["type"] in _BOUND_ERRORS and (bound := _bound_problem(err, loc)) is not None:
        return bound
    if err["type"] in _KIND_ERRORS and (kind := _kind_problem(err, loc)) is not None:
        return kind
    dotted = ".".join(loc)
    if err["type"] == "extra_forbidden" and loc[-1] in _PRECISION_FLAGS:
        return (
            f"unknown key {dotted!r}; precision is one key with one value: use train.precision=bf16, "
            "train.precision=fp16 or train.precision=fp32 (bf16 and fp16 cannot both be on)"
        )
    if err["type"] == "extra_forbidden":
        owner = _schema_at(loc[:-1])
        known = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        prefix = ".".join(loc[:-1])
        hint = f"did you mean {'.'.join([*loc[:-1], close[0]]) if close else ''!r}?" if close else ""
        valid = f"valid keys{' under ' + prefix if prefix else ''}: {', '.join(known)}"
        return f"unknown key {dotted!r}; {hint + ' ' if hint else ''}({valid})"
    # A schema validator's own message already says the rule and the fix; pydantic prefixes "Value error, ".
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"{dotted} = {shown(err.get('input'))}: {message}"


def validate_config(raw: dict[str, Any]) -> ZerofitConfig:
    """Validate a raw nested dict, turning every pydantic error into one line of a `ConfigError`."""
    try:
        return ZerofitConfig.model_validate(raw)
    except ValidationError as exc:
        # One union field fails once per member; report each location once, preferring the clearest line.
        lines: dict[str, tuple[int, str]] = {}
        for err in exc.errors():
            line = _format_error(dict(err))
            where = ".".join(_error_loc(dict(err)))
            # The member whose bound the value broke says more than a number member's kind, and that more
            # than the members of other types (`train.tiled_mlp=4.5`: not `Input should be False`).
            rank = 0 if err["type"] in _BOUND_ERRORS else 1 if err["type"] in _KIND_ERRORS else 2
            if where not in lines or rank < lines[where][0]:
                lines[where] = (rank, line)
        raise ConfigError([line for _, line in lines.values()]) from None


def _config_text(file: Path) -> str:
    """The file's text, read as UTF-8 (what YAML files are); any other encoding is refused with the byte."""
    data = file.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            [
                f"config file {str(file)!r} is not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset "
                f"{exc.start} (line {line}) is no UTF-8; save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 "
                "OLD > NEW`, or your editor's encoding setting)"
            ]
        ) from None


def read_config_file(file: Path) -> dict[str, Any]:
    """The mapping a YAML config file holds; a file that is no UTF-8, no YAML, no mapping or that expands
    beyond `MAX_CONFIG_VALUES` values is one `ConfigError` naming it."""
    try:
        loaded = load_yaml(_config_text(file))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"config file {str(file)!r} is not valid YAML{where}: {problem}"]) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            [f"config file {str(file)!r} must hold a mapping of keys, got {type(loaded).__name__}"]
        )
    if _expands_beyond_limit(loaded):
        raise ConfigError([_too_big(f"config file {str(file)!r}", "file")])
    return loaded


def refuse_null_run_name(overrides: dict[str, Any]) -> None:
    """An override that sets `run_name` to null (`run_name=null` / `~`, the API's `run_name=None`) is refused:
    it names no run, and taking the derived name instead would ignore what the user wrote. (In a config file
    `run_name: null` is the key left out, as a dump of an unresolved config writes it.)"""
    if "run_name" in overrides and overrides["run_name"] is None:
        raise ConfigError(
            [
                "run_name = null: the override sets run_name to null (run_name=null or run_name=~), which "
                "names no run folder; set a name (run_name=NAME, one folder name under output_dir), or leave "
                "the override out for the name derived from the model, method, preset, precision and batch "
                "(e.g. tiny-llama-lora-zero2-bf16-g16)"
            ]
        )


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> ZerofitConfig:
    """Load `path` (YAML; None = all defaults), apply dotted overrides, and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(
                [f"config file {str(file)!r} does not exist (pass an existing YAML file to --config)"]
            )
        raw = read_config_file(file)
    overrides = list(overrides)
    nested = parse_overrides(overrides)
    refuse_null_run_name(nested)
    config = validate_config(deep_merge(raw, nested))
    config.mark_overridden(frozenset(item.partition("=")[0].strip() for item in overrides))
    return config
