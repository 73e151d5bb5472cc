"""The user's own code named in the config as `module:name` (a reward function, a tool, an environment
class), imported at launch: only a launch calls this, from the config the user launched with; a run
folder's saved config.yaml is data, never imported from."""

from __future__ import annotations

import importlib
from typing import Any

from zerofit.core.errors import ConfigError

__all__ = ["import_user_object"]


def import_user_object(where: str, name: str, what: str = "function") -> Any:
    """The callable `module:attr` that `where` (`rl.rewards[0].function = 'm:f'`) names, imported now;
    ConfigError (one paragraph) when the module does not import or has no such callable `what`."""
    module_name, attr = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            [
                f"{where}: no module {exc.name!r} can be imported; put {module_name.replace('.', '/')}.py on "
                "PYTHONPATH (for a file in the current directory, launch with PYTHONPATH=.)"
            ]
        ) from None
    except Exception as exc:
        raise ConfigError(
            [f"{where}: importing module {module_name!r} raised {type(exc).__name__}: {exc}; fix the module"]
        ) from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise ConfigError(
            [f"{where}: module {module_name!r} has no {what} {attr!r}; name a {what} it defines"]
        )
    return found
