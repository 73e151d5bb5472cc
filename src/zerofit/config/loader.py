"""Read a YAML run config, apply dotted `key=value` overrides, validate into `ZerofitConfig`.

Every problem becomes one line of a single `ConfigError`: unknown keys get a did-you-mean against the
schema, bad values name the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from zerofit.config.schema import RuleHint, ZerofitConfig
from zerofit.errors import ConfigError


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Turn `["batch.global_batch_size=64", "lora.target_modules=[q_proj,v_proj]"]` into a nested dict.

    Values are parsed as YAML scalars/flow lists, so `64` is an int, `true` a bool, `[a,b]` a list and
    `null` None; anything else stays a string.
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
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # e.g. an unbalanced bracket: keep the literal text, the schema will judge it
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


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Return `base` with `update` merged in recursively (update wins; neither input is modified)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
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
    return f"{value:g}"


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
    lower = next((m for m in constraints if isinstance(m, annotated_types.Gt | annotated_types.Ge)), None)
    upper = next((m for m in constraints if isinstance(m, annotated_types.Lt | annotated_types.Le)), None)
    if lower is not None and upper is not None:
        low = f"({_number(lower.gt)}" if isinstance(lower, annotated_types.Gt) else f"[{_number(lower.ge)}"
        high = f"{_number(upper.lt)})" if isinstance(upper, annotated_types.Lt) else f"{_number(upper.le)}]"
        return f"must be in {low}, {high}"
    bound = lower or upper
    symbol, value = {
        annotated_types.Gt: (">", "gt"),
        annotated_types.Ge: (">=", "ge"),
        annotated_types.Lt: ("<", "lt"),
        annotated_types.Le: ("<=", "le"),
    }[type(bound)]
    return f"must be {symbol} {_number(getattr(bound, value))}"


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
    return f"{'.'.join(loc)} = {value!r}: {_bound_rule(constraints)}" + (f" ({hint})" if hint else "")


def _format_error(err: dict[str, Any]) -> str:
    loc = _error_loc(err)
    if err["type"] in _BOUND_ERRORS and (bound := _bound_problem(err, loc)) is not None:
        return bound
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
    return f"{dotted} = {err.get('input')!r}: {message}"


def validate_config(raw: dict[str, Any]) -> ZerofitConfig:
    """Validate a raw nested dict, turning every pydantic error into one line of a `ConfigError`."""
    try:
        return ZerofitConfig.model_validate(raw)
    except ValidationError as exc:
        # One union field fails once per member; report each location once, preferring the clearest line.
        lines: dict[str, str] = {}
        for err in exc.errors():
            line = _format_error(dict(err))
            where = ".".join(_error_loc(dict(err)))
            # The member whose bound the value broke says more than the members of other types.
            if err["type"] in _BOUND_ERRORS or where not in lines:
                lines[where] = line
        raise ConfigError(list(lines.values())) from None


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> ZerofitConfig:
    """Load `path` (YAML; None = all defaults), apply dotted overrides, and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(
                [f"config file {str(file)!r} does not exist (pass an existing YAML file to --config)"]
            )
        try:
            loaded = yaml.safe_load(file.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError([f"config file {str(file)!r} is not valid YAML{where}: {problem}"]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                [f"config file {str(file)!r} must hold a mapping of keys, got {type(loaded).__name__}"]
            )
        raw = loaded
    overrides = list(overrides)
    config = validate_config(deep_merge(raw, parse_overrides(overrides)))
    config.mark_overridden(frozenset(item.partition("=")[0].strip() for item in overrides))
    return config
