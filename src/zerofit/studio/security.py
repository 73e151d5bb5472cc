"""The studio's two guards: a random token every request must carry, and a workspace root every path stays in.

As Jupyter does, the token is in the URL `zerofit studio` prints; the first visit with it sets a cookie
(HttpOnly, SameSite=Strict), so the page's own requests and its event streams carry it without the URL. A
request with neither is refused (403) before any route runs. Paths the page names (a config, a run, a model
folder, a plot) are resolved against the workspace root and refused outside it, symlinks followed.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from zerofit.core.errors import ZerofitError

TOKEN_PARAM = "token"  # the URL's query parameter
TOKEN_COOKIE = "zerofit_studio_token"  # + `_<port>`: each studio on a host its own
TOKEN_HEADER = "x-zerofit-token"


def new_token() -> str:
    """A fresh random token (32 bytes of the OS's randomness, URL-safe)."""
    return secrets.token_urlsafe(32)


def token_matches(given: str | None, token: str) -> bool:
    """Whether `given` is the server's token (compared in constant time)."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def refusal(reason: str) -> str:
    """The paragraph a request without the token gets."""
    return (
        f"zerofit studio: {reason}; open the URL `zerofit studio` printed (it carries ?{TOKEN_PARAM}=...), "
        "or pass the token in that query parameter or the X-Zerofit-Token header"
    )


class OutsideWorkspace(ZerofitError):
    """A path the page named lies outside the workspace root (the server answers 403)."""


class Workspace:
    """The folder the studio serves: paths the page names are relative to it and must stay inside it."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, text: str, what: str) -> Path:
        """`text` (relative to the root, or absolute) as a resolved path inside the root; `what` names the
        field in the refusal (`OutsideWorkspace`: one paragraph)."""
        candidate = Path(text).expanduser()
        resolved = (candidate if candidate.is_absolute() else self.root / candidate).resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise OutsideWorkspace(
                f"{what} = {text!r} is outside the studio's workspace {self.root}: the studio reads and writes "
                "only inside it; pick a path under it, or restart `zerofit studio --workspace DIR` with a "
                "folder that holds it"
            )
        return resolved

    def relative(self, path: Path) -> str:
        """`path` as the page shows it: relative to the root where it is inside it."""
        try:
            return path.resolve().relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def model(self, text: str) -> str:
        """A model field as `model.name_or_path` takes it: a path (it starts with `/`, `~` or `.`, or names
        something in the workspace) resolved inside the workspace and refused outside it; else the name as
        typed (a built-in model such as tiny-llama, or a hub id)."""
        text = text.strip()
        if text.startswith(("/", "~", ".")) or (text and (self.root / text).exists()):
            return str(self.path(text, "model"))
        return text
