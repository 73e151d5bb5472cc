"""A hub id that cannot be used is said at once, with the models that can, not after ~25 s of retries.

huggingface_hub retries a request that cannot connect (DNS failure, no route, a proxy that drops it) with
backoff, and transformers asks for several files: a misspelled id on a machine without network, or with
`HF_HUB_OFFLINE=1`, spent about 25 s before its error. `check_hub_id` decides first, with at most one
request and no retries: an id in the local Hugging Face cache passes without network; offline mode, an
unreachable hub or an id the hub does not have is one paragraph naming the id, the cause and the models
there are (`models_hint`, the one home of that paragraph, which `zerofit plan`, a launch and `zerofit
generate` all print; the names come from the catalogue, `catalogue.models.known_models`):

    did you mean    the closest built-in models, cached models and catalogued hub ids (difflib, case
                    ignored; a built-in's upstream hub id suggests the built-in itself)
    trains offline  the built-in models, and the models in the local Hugging Face cache (config and weights)
    plan only       the catalogue's hub ids whose weights are not here: `zerofit plan` reads their shapes

An `hf download` command is only ever suggested for an id known to be on the hub (a catalogued one), and only
when the hub could not be reached; never for a built-in name or an id that may be a misspelling.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from zerofit.core.errors import ConfigError, LaunchError

__all__ = ["QUICK_TIMEOUT_S", "KnownModels", "check_hub_id", "models_hint"]

_KEY = "model.name_or_path"
QUICK_TIMEOUT_S = 5.0  # the one existence request: a hub that answers at all answers well within this
_FOUND: set[str] = set()  # ids the hub confirmed in this process: asked once, not per config read
_CLOSE = 0.6  # difflib's similarity for a did-you-mean (its own default)
_LOCAL_FOLDER = f"point {_KEY} at a local model folder"


@dataclass(frozen=True)
class KnownModels:
    """The models zerofit knows before any network (`catalogue.models.known_models` builds it)."""

    builtins: tuple[str, ...]  # the built-in models' names: each trains offline
    upstream: dict[str, str]  # a built-in pretrained model's name -> its upstream hub id
    hub_ids: tuple[str, ...]  # the catalogue's hub ids: their shapes are here, their weights are not


@dataclass(frozen=True)
class _Candidate:
    """One model a did-you-mean may name: the spelling a name is compared with, what to type, what it is."""

    key: str
    name: str
    what: str


def _cached_models() -> list[str]:
    """The model repos of the local Hugging Face cache with a config.json and safetensors weights: what loads
    without network (a scan of the cache folder, no request); [] when there is no cache."""
    from huggingface_hub import constants, scan_cache_dir

    try:
        repos = scan_cache_dir(constants.HF_HUB_CACHE).repos  # the folder `try_to_load_from_cache` reads
    except Exception:  # no cache folder, or one it cannot read: nothing cached to offer
        return []
    found = []
    for repo in repos:
        files = (
            {f.file_name for rev in repo.revisions for f in rev.files} if repo.repo_type == "model" else set()
        )
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            found.append(repo.repo_id)
    return sorted(found)


def _candidates(known: KnownModels, cached: list[str], unreachable: bool) -> list[_Candidate]:
    """Every model a did-you-mean may name (see the module docstring); `unreachable`: the hub cannot be
    reached from here, so a catalogued id needs a download elsewhere first."""
    found = [_Candidate(name, name, "built in, trains offline") for name in known.builtins]
    for builtin, hub_id in known.upstream.items():
        found.append(_Candidate(hub_id, builtin, f"built in: {hub_id}, trains offline"))
    found += [_Candidate(name, name, "in the Hugging Face cache, trains offline") for name in cached]
    for name in known.hub_ids:
        if name not in cached:
            later = f"plan only here, until `hf download {name}` where there is network"
            found.append(_Candidate(name, name, later if unreachable else "on the hub"))
    return found


def _close(name: str, candidates: list[_Candidate]) -> list[_Candidate]:
    """The (at most two) candidates closest to `name`, case ignored; none that is `name` itself."""
    by_key: dict[str, _Candidate] = {}
    for candidate in candidates:
        if candidate.name != name:
            by_key.setdefault(candidate.key.lower(), candidate)
    close: list[_Candidate] = []
    for key in difflib.get_close_matches(name.lower(), list(by_key), n=4, cutoff=_CLOSE):
        if by_key[key].name not in {c.name for c in close}:
            close.append(by_key[key])
    return close[:2]


def models_hint(name: str, known: KnownModels, *, unreachable: bool = False) -> str:
    """What a message about an unusable `name` says of the models there are (see the module docstring): a
    did-you-mean, what trains offline here, what can only be planned. `unreachable`: the hub cannot be
    reached from here (offline mode, no network)."""
    cached = _cached_models()
    close = _close(name, _candidates(known, cached, unreachable))
    guess = f"did you mean {' or '.join(f'{c.name} ({c.what})' for c in close)}? " if close else ""
    offline = f"trains offline here: the built-in models {', '.join(known.builtins)}"
    parts = [offline + (f", and from the Hugging Face cache {', '.join(cached)}" if cached else "")]
    plan_only = [hub_id for hub_id in known.hub_ids if hub_id not in cached]
    if plan_only:
        parts.append(
            "plan only (`zerofit plan` reads their shapes from zerofit's catalogue; their weights are not "
            f"here): {', '.join(plan_only)}"
        )
    known = "; ".join(parts)
    return f"{guess}{known[0].upper()}{known[1:]}" if guess else known


def _fetch_hint(name: str, known: KnownModels) -> str:
    """How to get `name` here when the hub cannot be reached: `hf download` only for an id known to be on
    the hub (a catalogued one); for any other hub-shaped id that is not close to a known one, a download in
    words; else (a built-in-like name, a likely misspelling) only a local folder."""
    if name in known.hub_ids or name in known.upstream.values():
        return f"download it once where there is network (`hf download {name}`, the same cache) or {_LOCAL_FOLDER}"
    if "/" in name and not _close(name, _candidates(known, _cached_models(), unreachable=True)):
        return f"if {name} is a model on the hub, download it once where there is network (the same cache), or {_LOCAL_FOLDER}"
    return f"check the spelling, or {_LOCAL_FOLDER}"


def _cached(name: str) -> bool:
    """True when the local Hugging Face cache holds the id's config.json (a download made earlier)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id: never cached
        return False


def check_hub_id(name: str, known: KnownModels) -> None:
    """Raise at once when hub id `name` cannot be used here (see the module docstring); return when it is a
    local path, cached, or known to the hub (the load that follows fetches it). A gated model passes: its
    load says what access is missing (`models.hub`). `known`: what a message suggests
    (`catalogue.models.known_models`); a built-in model's name is the caller's to pass by. A
    catalogued id is checked too: the catalogue holds its shape (`zerofit plan` needs no network), not its
    weights."""
    if name in _FOUND or Path(name).exists() or _cached(name):
        return
    from huggingface_hub import HfApi, is_offline_mode
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    if is_offline_mode():
        raise LaunchError(
            f"{_KEY} = {name!r}: offline mode is on (HF_HUB_OFFLINE=1) and {name} is neither a local folder nor "
            f"in the local Hugging Face cache, so nothing can load it; {models_hint(name, known, unreachable=True)}; "
            f"{_fetch_hint(name, known)}"
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
                f"({type(exc).__name__}); {models_hint(name, known)}; check the spelling of the id, log in if it is "
                "private (`hf auth login` or HF_TOKEN), or point it at a local folder with config.json"
            ]
        ) from None
    except Exception as exc:  # any transport failure (DNS, refused, timeout, a proxy): "unreachable"
        if _answered(exc):
            return  # the hub answered (a 5xx, a rate limit): the load's own retries and errors take over
        raise LaunchError(
            f"{_KEY} = {name!r}: the Hugging Face hub cannot be reached from here ({type(exc).__name__}: "
            f"{_first_line(exc)}) and {name} is not in the local cache; {models_hint(name, known, unreachable=True)}; "
            f"{_fetch_hint(name, known)}; or set HF_HUB_OFFLINE=1 to use only the cache"
        ) from None


def _answered(exc: BaseException) -> bool:
    """True for an HTTP error response (the hub is reachable), False for a failure to get any response."""
    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(exc, HfHubHTTPError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
