"""A hub id that cannot be used is said at once, with the ids zerofit knows, not after ~25 s of retries.

huggingface_hub retries a request that cannot connect (DNS failure, no route, a proxy that drops it) with
backoff, and transformers asks for several files: a misspelled id on a machine without network, or with
`HF_HUB_OFFLINE=1`, spent about 25 s before its error. `check_hub_id` decides first, with at most one
request and no retries: an id in the local Hugging Face cache passes without network; offline mode, an
unreachable hub or an id the hub does not have is one paragraph naming the id, the cause, the closest
known id and the ids that work without network (the built-in models and the catalogue's shapes).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from zerofit.core.errors import ConfigError, LaunchError

__all__ = ["QUICK_TIMEOUT_S", "check_hub_id"]

_KEY = "model.name_or_path"
QUICK_TIMEOUT_S = 5.0  # the one existence request: a hub that answers at all answers well within this
_FOUND: set[str] = set()  # ids the hub confirmed in this process: asked once, not per config read


def _known(name: str, known: Sequence[str]) -> str:
    """`did you mean X or Y?` (the two closest `known` ids, if any is close) and the known ids, for a message."""
    close = difflib.get_close_matches(name, [k for k in known if k != name], n=2, cutoff=0.6)
    guess = f"did you mean {' or '.join(close)}? " if close else ""
    return f"{guess}known without network: {', '.join(known)}"


def _cached(name: str) -> bool:
    """True when the local Hugging Face cache holds the id's config.json (a download made earlier)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id: never cached
        return False


def check_hub_id(name: str, known: Sequence[str]) -> None:
    """Raise at once when hub id `name` cannot be used here (see the module docstring); return when it is a
    local path, cached, or known to the hub (the load that follows fetches it). A gated model passes: its
    load says what access is missing (`models.hub`). `known`: the ids to suggest
    (`catalogue.models.known_model_ids`); a built-in model's name is the caller's to pass by. A catalogued
    id is checked too: the catalogue holds its shape (`zerofit plan` needs no network), not its weights."""
    if name in _FOUND or Path(name).exists() or _cached(name):
        return
    from huggingface_hub import HfApi, is_offline_mode
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    if is_offline_mode():
        raise LaunchError(
            f"{_KEY} = {name!r}: offline mode is on (HF_HUB_OFFLINE=1) and {name} is not in the local Hugging "
            f"Face cache, so nothing can load it; {_known(name, known)}; or download it once where there is network "
            f"(`hf download {name}`, the same cache) or point {_KEY} at a local model folder"
        )
    try:
        HfApi().model_info(name, timeout=QUICK_TIMEOUT_S)
        _FOUND.add(name)
    except GatedRepoError:
        return
    except (RepositoryNotFoundError, HFValidationError) as exc:
        raise ConfigError(
            [
                f"{_KEY} = {name!r} is neither a local folder nor a model on the Hugging Face hub "
                f"({type(exc).__name__}); {_known(name, known)}; check the spelling of the id, log in if it is "
                "private (`hf auth login` or HF_TOKEN), or point it at a local folder with config.json"
            ]
        ) from None
    except Exception as exc:  # any transport failure (DNS, refused, timeout, a proxy): "unreachable"
        if _answered(exc):
            return  # the hub answered (a 5xx, a rate limit): the load's own retries and errors take over
        raise LaunchError(
            f"{_KEY} = {name!r}: the Hugging Face hub cannot be reached from here ({type(exc).__name__}: "
            f"{_first_line(exc)}) and {name} is not in the local cache; {_known(name, known)}; or download it once "
            f"where there is network (`hf download {name}`, the same cache), copy the folder here and set "
            f"{_KEY}=/path/to/that/folder, or set HF_HUB_OFFLINE=1 to use only the cache"
        ) from None


def _answered(exc: BaseException) -> bool:
    """True for an HTTP error response (the hub is reachable), False for a failure to get any response."""
    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(exc, HfHubHTTPError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
