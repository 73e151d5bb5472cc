"""A model that cannot be fetched from the Hugging Face hub is one paragraph, not an 85-line traceback.

`from_pretrained` on a hub id fails in a handful of ways a user can act on: the id does not exist (or is
private), the model is gated and this machine has no accepted licence / token for it, or the hub cannot be
reached (offline, `HF_HUB_OFFLINE=1`) and the files are not in the local cache. transformers reports all of
them as an `OSError` whose first lines say which; `hub_errors` turns that into a `ConfigError` (the id is
wrong) or a `LaunchError` (the machine lacks access), naming `model.name_or_path`, the cause and the fix.
Local folders and other errors pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zerofit.errors import ConfigError, LaunchError

__all__ = ["hub_errors", "hub_problem"]

_KEY = "model.name_or_path"


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


@contextmanager
def hub_errors(name: str, what: str) -> Iterator[None]:
    """Translate hub access failures inside the block into one clear `ZerofitError` (see `hub_problem`)."""
    try:
        yield
    except (OSError, ValueError) as exc:
        problem = hub_problem(name, what, exc)
        if problem is None:
            raise
        raise problem from None
