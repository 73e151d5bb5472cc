"""`zerofit studio [--port N] [--host ADDR] [--workspace DIR] [--no-browser]`: plan, launch, watch, compare and
chat in a browser, on the command line's own code (`zerofit.studio`).

Serves a local web app on 127.0.0.1 and prints its URL with a random token (as Jupyter does); every request
needs that token. `--host` serves on another interface: the token is still required, and the command says so.
Paths stay inside the workspace (default: this folder), where runs are launched as a terminal here would.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError
from zerofit.core.messages import say, warn

# This subcommand lives beside the app it serves, not in `zerofit.commands`: the app calls the commands' code,
# so the commands stay below the studio and import nothing of it. Importing this module imports no web
# framework (`run` imports FastAPI and uvicorn), so `zerofit --help` needs no `studio` extra.
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def register(subparsers: Any) -> None:
    """Add the `studio` subcommand."""
    parser = subparsers.add_parser(
        "studio",
        help="a local web app: plan, launch, watch, compare and chat (needs `pip install zerofit[studio]`)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=7860, help="port to serve on (default 7860)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to serve on (default 127.0.0.1: this machine only); the token is required on any",
    )
    parser.add_argument(
        "--workspace",
        type=Path,
        default=Path.cwd(),
        metavar="DIR",
        help="the folder runs are launched in and every path stays inside (default: this folder)",
    )
    parser.add_argument("--no-browser", action="store_true", help="print the URL only; open no browser")
    parser.set_defaults(func=run)


def url_of(host: str, port: int, token: str) -> str:
    """The URL to open: the host as a browser writes it, the token in the query."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/?token={token}"


def run(args: argparse.Namespace) -> int:
    """Check the workspace, print the URL, serve until Ctrl-C."""
    try:
        import uvicorn

        from zerofit.studio.security import Workspace, new_token
        from zerofit.studio.server import create_app
    except ModuleNotFoundError as exc:
        raise ConfigError(
            [
                f"zerofit studio needs {exc.name}, which is not installed; install it with "
                "`pip install zerofit[studio]`"
            ]
        ) from None
    if not args.workspace.is_dir():
        raise ConfigError([f"--workspace {args.workspace}: not a folder; pass an existing folder"])
    workspace = Workspace(args.workspace)
    # Relative paths of a config (data.path, output_dir) read as a terminal in the workspace reads them.
    os.chdir(workspace.root)
    token = new_token()
    url = url_of(args.host, args.port, token)
    if args.host not in LOCAL_HOSTS:
        warn(
            f"--host {args.host}: the studio is reachable from other machines on that interface; every request "
            "still needs the token in the URL below, so share it only with people who may launch runs here"
        )
    say(f"zerofit studio: workspace {workspace.root}")
    say(f"zerofit studio: open {url}")
    if not args.no_browser:
        import webbrowser

        webbrowser.open(url)
    uvicorn.run(create_app(token, workspace), host=args.host, port=args.port, log_level="warning")
    return 0
