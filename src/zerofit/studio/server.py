"""The studio's HTTP app: the page (`static/`), its JSON API and the live event stream of a run.

Every request passes `require_token` first (security.py). Each route hands its input to the command line's own
code through this package's modules and returns what they return; a user error comes back as the CLI's
paragraph (400; 403 for a path outside the workspace), never as a rule of the page's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from zerofit.core.errors import ConfigError, ZerofitError
from zerofit.studio import pages
from zerofit.studio.chat import Chats
from zerofit.studio.exports import Exports
from zerofit.studio.launches import LaunchQueue
from zerofit.studio.runs import RunWatch
from zerofit.studio.security import (
    TOKEN_COOKIE,
    TOKEN_HEADER,
    TOKEN_PARAM,
    OutsideWorkspace,
    Workspace,
    refusal,
    token_matches,
)

POLL_S = 0.5  # how often a watched run's files are read for the event stream
STATIC = Path(str(resources.files("zerofit.studio"))) / "static"


class Studio:
    """What the routes share: the token, the workspace, the launch queue, the loaded chat models, exports."""

    def __init__(self, token: str, workspace: Workspace) -> None:
        self.token = token
        self.workspace = workspace
        self.queue = LaunchQueue(workspace)
        self.chats = Chats(workspace)
        self.exports = Exports(workspace)


def studio_of(request: Request) -> Studio:
    """The app's `Studio`."""
    return request.app.state.studio


async def require_token(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Refuse (403) a request without the token; the first visit with it in the URL gets the cookie."""
    token = studio_of(request).token
    # Cookies are per host, not per port: each studio on this machine names its own.
    cookie = f"{TOKEN_COOKIE}_{request.url.port}"
    in_url = request.query_params.get(TOKEN_PARAM)
    given = in_url or request.cookies.get(cookie) or request.headers.get(TOKEN_HEADER)
    if not token_matches(given, token):
        reason = "wrong token" if given else "this request carries no token"
        return PlainTextResponse(refusal(reason), status_code=403)
    response = await call_next(request)
    if token_matches(in_url, token):
        response.set_cookie(cookie, token, httponly=True, samesite="strict")
    return response


# The routes whose input is a run config (the plan form); elsewhere a ConfigError is about a flag or a path,
# and, as `zerofit generate` / `export` print theirs, it drops the "Invalid configuration" heading.
CONFIG_ROUTES = ("/api/form", "/api/plan", "/api/remedy", "/api/launch")


def user_error(request: Request, exc: Exception) -> JSONResponse:
    """A user error as the CLI's paragraph (and its problems by form field)."""
    from zerofit.studio.planning import problems_by_field

    assert isinstance(exc, ZerofitError)
    status = 403 if isinstance(exc, OutsideWorkspace) else 400
    own = isinstance(exc, ConfigError) and request.url.path not in CONFIG_ROUTES
    text = exc.without_heading() if isinstance(exc, ConfigError) and own else str(exc)
    return JSONResponse({"error": text, "problems": problems_by_field(exc)}, status_code=status)


router = APIRouter()


@router.get("/")
def index() -> FileResponse:
    """The page."""
    return FileResponse(STATIC / "index.html")


@router.get("/api/options")
def options(request: Request) -> dict[str, Any]:
    """The choices of the plan form."""
    return pages.options(studio_of(request).workspace)


@router.get("/api/form")
def form(request: Request, config: str) -> dict[str, Any]:
    """The plan form as config file `config` fills it."""
    return pages.form(studio_of(request).workspace, config)


@router.post("/api/plan")
def plan(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """`zerofit plan --json` for the form."""
    return pages.plan(studio_of(request).workspace, body)


@router.post("/api/remedy")
def remedy(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """The form with a remedy applied, and its plan."""
    return pages.remedy(studio_of(request).workspace, body)


@router.post("/api/launch")
def launch(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """Plan the form, write its config into the run folder, queue the launch."""
    studio = studio_of(request)
    return pages.launch(studio.workspace, studio.queue, body)


@router.get("/api/runs")
def runs(request: Request) -> dict[str, Any]:
    """Every run in the workspace and every job of this studio."""
    studio = studio_of(request)
    return pages.runs(studio.workspace, studio.queue)


@router.post("/api/stop")
def stop(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """Stop a job as Ctrl-C would."""
    studio = studio_of(request)
    return studio.queue.stop(int(body.get("job") or 0)).as_dict(studio.workspace)


@router.post("/api/resume")
def resume(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """Resume a run from its newest checkpoint (`checkpoint.resume=true`)."""
    studio = studio_of(request)
    return pages.resume(studio.workspace, studio.queue, str(body.get("run", "")))


@router.get("/api/events")
async def events(request: Request, run: str) -> StreamingResponse:
    """The run's live stream (server-sent events): rows, status, completions, log."""
    studio = studio_of(request)
    run_dir = studio.workspace.path(run, "run")
    watch = RunWatch(run_dir)

    async def stream() -> AsyncIterator[str]:
        while not await request.is_disconnected():
            state = pages.state_of(studio.queue, run_dir)
            for name, data in await asyncio.to_thread(watch.poll, state):
                yield f"event: {name}\ndata: {json.dumps(data, default=str)}\n\n"
            await asyncio.sleep(POLL_S)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/api/log")
def log(request: Request, run: str) -> dict[str, Any]:
    """The end of the output of the run's newest job (what the terminal would have shown)."""
    studio = studio_of(request)
    return pages.log_tail(studio.workspace, studio.queue, run)


@router.post("/api/compare")
def compare(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """`zerofit compare`'s tables and plots for the runs picked."""
    return pages.compare(studio_of(request).workspace, [str(r) for r in body.get("runs", [])])


@router.get("/api/file")
def file(request: Request, path: str) -> FileResponse:
    """A file inside the workspace (a plot); a path outside it is refused."""
    target = studio_of(request).workspace.path(path, "path")
    if not target.is_file():
        raise pages.not_a_file(path)
    return FileResponse(target)


@router.post("/api/chat")
def chat(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """`zerofit generate`'s answer of a run, an export or a model."""
    chats = studio_of(request).chats
    text = chats.reply(
        str(body.get("model", "")),
        str(body.get("prompt", "")),
        int(body.get("max_new_tokens", 64)),
        float(body.get("temperature", 0.0)),
        str(body.get("image") or ""),
    )
    return {"text": text}


@router.post("/api/export")
def export(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """Start `zerofit export` of a run (adapter, merged or GGUF)."""
    return studio_of(request).exports.start(str(body.get("run", "")), str(body.get("kind", ""))).as_dict()


@router.get("/api/exports")
def exports(request: Request) -> list[dict[str, Any]]:
    """The exports started, with their output so far."""
    return [e.as_dict() for e in studio_of(request).exports.started]


def create_app(token: str, workspace: Workspace) -> FastAPI:
    """The app: token check first, the routes, the static files, user errors as paragraphs."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.studio = Studio(token, workspace)
    app.middleware("http")(require_token)
    app.add_exception_handler(ZerofitError, user_error)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
