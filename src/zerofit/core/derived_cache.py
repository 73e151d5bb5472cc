"""Facts derived from a model's config by a heavy library, kept on disk (`$ZEROFIT_CACHE/planner/`) as JSON
under a key that cannot go stale: what a meta-device build of a model measured (the planner's shapes and LoRA
counts, `zerofit plan`'s LoRA report) and the FSDP block class transformers' model class declares, for the
models whose layout `zerofit.catalogue.layouts` does not read from the config alone.

A key is the SHA-256 of everything the entry depends on: the model's config.json dict, the settings asked
for (LoRA rank, targets, ...), the versions of the libraries that build and adapt the model (transformers,
peft, torch) and zerofit's own source, so an upgrade or an edit of any of them misses instead of reading an
old answer. An entry is data: it is parsed as JSON, never executed, and each reader checks its fields before
use (`conforms`; a missing, unreadable or malformed entry is computed again and rewritten). A cache that
cannot be written (a read-only home, a full disk) never breaks planning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

from zerofit.core.cache_dirs import cache_root
from zerofit.core.digest import files_sha256

__all__ = ["cache_key", "conforms", "read_cache", "write_cache"]

# The libraries whose classes decide what a meta-device build holds and what peft adapts in it.
_LIBRARIES = ("transformers", "peft", "torch")
_SOURCE = Path(__file__).resolve().parents[1]  # the `zerofit` package


def _cache_dir() -> Path:
    """`$ZEROFIT_CACHE/planner`."""
    return cache_root() / "planner"


@lru_cache(maxsize=1)
def _library_versions() -> dict[str, str]:
    """The installed version of each library a build depends on ("none" when absent)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in _LIBRARIES:
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "none"
    return out


@lru_cache(maxsize=1)
def _source_digest() -> str:
    """SHA-256 of zerofit's own Python source (~5 ms): the code that maps, builds and counts."""
    return files_sha256(sorted(_SOURCE.rglob("*.py")))


def cache_key(kind: str, version: int, payload: dict[str, Any]) -> str:
    """The entry name for `payload` (JSON-able) of `kind` at the entry layout `version`."""
    blob = json.dumps(
        {"v": version, "kind": kind, "libs": _library_versions(), "code": _source_digest(), **payload},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def read_cache(key: str) -> dict[str, Any] | None:
    """The entry `key` as a JSON object; None when absent or not a readable JSON object (the caller checks
    its fields)."""
    try:
        data = json.loads((_cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_cache(key: str, data: dict[str, Any]) -> None:
    """Write the entry atomically (a temporary file renamed into place); a failure to write is ignored."""
    try:
        directory = _cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{key}.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(data))
        tmp.replace(directory / f"{key}.json")
    except OSError:
        pass


def conforms(value: Any, hint: Any) -> bool:
    """Whether a value read from JSON has the type `hint` says: int, float, bool, str, None, unions,
    `list[X]`, `tuple[X, ...]`, `tuple[X, Y]`, `dict[str, X]`, a dataclass as the dict of its fields or a
    `TypedDict` (an entry's check before use: a field of the wrong type is a malformed entry)."""
    if hint is Any:
        return True
    if hint in (int, str, bool, type(None)):
        return type(value) is hint  # JSON's true is not an int here, nor 1 a bool
    if hint is float:
        return type(value) in (int, float)
    if typing.is_typeddict(hint) or dataclasses.is_dataclass(hint):
        return _fields_conform(value, typing.get_type_hints(hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in args)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and conforms(v, args[1]) for k, v in value.items()
        )
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        if origin is tuple and args[-1:] != (Ellipsis,):
            return len(value) == len(args) and all(map(conforms, value, args))
        return all(conforms(v, args[0]) for v in value)
    return False


def _fields_conform(value: Any, hints: dict[str, Any]) -> bool:
    """`value` is a dict with exactly the fields of `hints`, each of its type."""
    return (
        isinstance(value, dict)
        and set(value) == set(hints)
        and all(conforms(value[name], hint) for name, hint in hints.items())
    )
