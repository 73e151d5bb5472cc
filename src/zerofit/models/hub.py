"""A model that cannot be fetched from the Hugging Face hub, or that needs code of its own, is one paragraph,
not an 85-line traceback.

`from_pretrained` on a hub id fails in a handful of ways a user can act on: the id does not exist (or is
private), the model is gated and this machine has no accepted licence / token for it, or the hub cannot be
reached (offline, `HF_HUB_OFFLINE=1`) and the files are not in the local cache. transformers reports all of
them as an `OSError` whose first lines say which; `hub_errors` turns that into a `ConfigError` (the id is
wrong) or a `LaunchError` (the machine lacks access), naming `model.name_or_path`, the cause and the fix.
Local folders and other errors pass through unchanged. Before any of that, an id not in the local cache is
checked with one quick request (`zerofit.catalogue.hub_ids.check_hub_id`): offline, unreachable or unknown
is said at once with the known ids, not after the hub client's retries.

A model or tokenizer folder whose config.json / tokenizer_config.json has an `auto_map` names Python files
transformers imports when `trust_remote_code` is on (`remote_code` lists them, reading the JSON only). Loaded
with it off, transformers refuses a model type it does not know; `hub_errors` turns that refusal into one
paragraph naming the folder, the `auto_map` entry and the opt-in (nothing ran).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.catalogue.hub_ids import check_hub_id
from zerofit.catalogue.models import is_builtin_model, known_models
from zerofit.core.errors import ConfigError, LaunchError

__all__ = [
    "AUTO_MAP_FILES",
    "RemoteCode",
    "allowed_remote_code",
    "hub_errors",
    "hub_problem",
    "remote_code",
    "remote_code_problem",
]

_KEY = "model.name_or_path"
# The files whose `auto_map` makes transformers import a folder's own code (with trust_remote_code on).
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")
REMOTE_CODE_OPT_IN = (
    "only if you trust that folder's source, opt in yourself: for training, model.trust_remote_code: true in "
    "your own config; for `zerofit export` / `zerofit generate` (of a run trained with it, or of the model "
    "itself), --trust-remote-code"
)


@dataclass(frozen=True)
class RemoteCode:
    """One `auto_map` entry: the Python file transformers would import to load a model or tokenizer."""

    folder: str  # the model or tokenizer folder (or hub id) that names it
    file: str  # <folder>/modeling_x.py, or <other repo>/modeling_x.py for a `repo--module.Class` reference
    entry: (
        str  # where it is named, e.g. config.json auto_map AutoModelForCausalLM = 'modeling_x.XForCausalLM'
    )

    def describe(self) -> str:
        """`file (entry)`, for a message."""
        return f"{self.file} ({self.entry})"


def _json_file(name_or_path: str, filename: str) -> dict[str, Any]:
    """`filename` of a local folder, or of a hub id from the local cache / the hub (a few KB, no code run);
    {} when it is missing or unreadable (the load that follows reports an unreachable model)."""
    try:
        local = Path(name_or_path) / filename
        if local.is_file():
            path: Any = local
        elif Path(name_or_path).exists():
            return {}
        else:
            from transformers.utils import cached_file

            path = cached_file(
                name_or_path,
                filename,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
        data = json.loads(Path(path).read_text(encoding="utf-8")) if path else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _references(value: Any) -> list[str]:
    """The class references of one `auto_map` value: a string, or a tokenizer's [slow, fast] pair."""
    values = value if isinstance(value, list | tuple) else [value]
    return [v for v in values if isinstance(v, str) and v]


def remote_code(name_or_path: str) -> list[RemoteCode]:
    """The Python files a model or tokenizer folder (or hub id) would run when loaded with trust_remote_code:
    every `auto_map` entry of its config.json and tokenizer_config.json, read as JSON (nothing imported)."""
    found: list[RemoteCode] = []
    for filename in AUTO_MAP_FILES:
        auto_map = _json_file(name_or_path, filename).get("auto_map")
        if not isinstance(auto_map, dict):
            continue
        for key, value in auto_map.items():
            for reference in _references(value):
                repo, _, local = reference.rpartition("--")
                module = local.rsplit(".", 1)[0]
                file = f"{(repo or name_or_path).rstrip('/')}/{module.replace('.', '/')}.py"
                found.append(RemoteCode(name_or_path, file, f"{filename} auto_map {key} = {reference!r}"))
    return found


def remote_code_problem(folder: str) -> ConfigError:
    """transformers refused `folder` (trust_remote_code off, a model type it has no class of its own for):
    one paragraph naming the folder, its `auto_map` entries and the opt-in."""
    found = remote_code(folder)
    named = "; ".join(code.describe() for code in found[:3]) if found else "an auto_map entry"
    return ConfigError(
        [
            f"{folder} needs Python code of its own to load ({named}), and trust_remote_code is off, so "
            f"transformers refused to load it and nothing ran; {REMOTE_CODE_OPT_IN}"
        ]
    )


def hub_problem(name: str, what: str, exc: BaseException) -> ConfigError | LaunchError | None:
    """The user error for `exc`, raised while loading `what` (`tokenizer`, `weights`) of hub id `name`;
    None when `exc` is not a hub access problem (a local folder, or a bug to keep the traceback of)."""
    if Path(name).exists() or not isinstance(exc, OSError | ValueError):
        return None
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    lowered = text.lower()
    type_names = {cls.__name__ for cls in type(exc).__mro__}
    if "gated repo" in lowered or "GatedRepoError" in type_names:
        return LaunchError(
            f"{_KEY} = {name!r} is a gated model on the Hugging Face hub and this machine has no access to its "
            f"{what}: accept its licence at https://huggingface.co/{name} with your account, then log in here "
            "(`hf auth login`, or set HF_TOKEN) — or download it where you have access and set "
            f"{_KEY}=/path/to/that/folder"
        )
    if "not a valid model identifier" in lowered or "RepositoryNotFoundError" in type_names:
        return ConfigError(
            [
                f"{_KEY} = {name!r} is neither a local folder nor a model on the Hugging Face hub ({first}); check "
                "the spelling of the id (e.g. meta-llama/Llama-2-7b-hf), log in if it is private (`hf auth "
                "login` or HF_TOKEN), or point it at a local folder with config.json and the weights"
            ]
        )
    if "couldn't connect" in lowered or "offline" in lowered or "LocalEntryNotFoundError" in type_names:
        return LaunchError(
            f"{_KEY} = {name!r}: the Hugging Face hub cannot be reached from here (no network, or "
            f"HF_HUB_OFFLINE=1) and its {what} is not in the local cache; download it once where there is "
            f"network (`hf download {name}`, which fills the same cache) or copy the model folder here and set "
            f"{_KEY}=/path/to/that/folder"
        )
    return None


def allowed_remote_code(saved: bool, flag: bool, folders: Iterable[str], where: str) -> bool:
    """The `trust_remote_code` to load with when a saved config (`where`: a run's config.yaml, an export's
    zerofit_export.json) says `saved`. A saved config is data: only the user's own `flag` (--trust-remote-code)
    turns remote code on. Without it, a folder of `folders` that would run code is refused (one paragraph
    naming the folder, the file and the flag); when none would, the load goes on with it off (nothing runs)."""
    if not saved:
        return False
    if flag:
        return True
    found = [code for folder in folders for code in remote_code(folder)]
    if not found:
        return False
    others = len(found) - 1
    more = f" (and {others} more auto_map entr{'y' if others == 1 else 'ies'})" if others else ""
    raise ConfigError(
        [
            f"{where} says model.trust_remote_code: true, and loading {found[0].folder} would run its code: "
            f"{found[0].describe()}{more}. A saved config is data, and zerofit runs no folder's code on its word "
            "alone, so nothing ran. Only if you trust that folder's source, pass --trust-remote-code yourself "
            "(zerofit export / zerofit generate ... --trust-remote-code); otherwise use a run whose base model "
            "needs no code of its own"
        ]
    )


def _needs_remote_code(exc: BaseException) -> bool:
    """True for transformers' refusal of a folder with custom code (`resolve_trust_remote_code`)."""
    return isinstance(exc, ValueError) and "trust_remote_code=True" in str(exc) and "custom code" in str(exc)


@contextmanager
def hub_errors(name: str, what: str, path: str | None = None) -> Iterator[None]:
    """Translate hub access failures inside the block into one clear `ZerofitError` (see `hub_problem`), and
    transformers' refusal of a folder that needs its own code (`remote_code_problem`); `path`: the folder
    `name` resolved to (a built-in model's cache folder), when it differs. A hub id that is not cached is
    first checked with one quick request (`check_hub_id`): offline or unknown is said at once."""
    if not is_builtin_model(name):  # a built-in model (tiny or pretrained) is built here, never fetched
        check_hub_id(name, known_models())
    try:
        yield
    except (OSError, ValueError) as exc:
        if _needs_remote_code(exc):
            raise remote_code_problem(path or name) from None
        problem = hub_problem(name, what, exc)
        if problem is None:
            raise
        raise problem from None
