"""`zerofit studio` in a real browser: Debian's Chromium driven by Playwright against the studio server this
module starts on localhost (a free port, a scratch workspace holding configs/ and data/ as a checkout does).

The walk: plan a run that does not fit -> a field's error shown beside it -> apply a remedy -> launch the
tiny model from the page -> watch its loss appear (server-sent events from metrics.jsonl) -> Stop (SIGINT, as
Ctrl-C: a checkpoint, then exit) -> Resume -> compare -> chat; each page's screenshot must not be blank. With
ZEROFIT_STUDIO_SCREENSHOTS=1 the screenshots are also written to docs/guides/studio/ (the guide's images).
The guards need no browser: a request without the token is refused, and so is a path outside the workspace;
a launch waits while another job holds the machine's queue, and a second launch into its folder is refused.

    launch   launcher   what
    walk     python     the studio's launch of tiny-llama (one process), stopped, resumed and stopped again
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launch_helpers import free_port

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = REPO / "docs" / "guides" / "studio"
WAIT_MS = 240_000  # a launch on a busy 2-core machine: torch's import, the model, steps of seconds


class Studio:
    """A running `zerofit studio`: its URL (with the token), token, workspace and process."""

    def __init__(self, url: str, workspace: Path, process: subprocess.Popen[str]) -> None:
        self.url, self.workspace, self.process = url, workspace, process
        self.base, _, self.token = url.partition("/?token=")

    def request(self, path: str, body: Any = None, token: str | None = "") -> tuple[int, str]:
        """(status, text) of a request to the studio; `token` "" = the right one, None = none."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["X-Zerofit-Token"] = token or self.token
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except urllib.error.URLError as exc:  # not listening yet
            return 0, str(exc)


def start_studio(workspace: Path, *flags: str) -> tuple[subprocess.Popen[str], str, str]:
    """`zerofit studio --no-browser` on a free port with `flags`: its process, URL and what it said before."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "zerofit.cli", "studio", "--no-browser", "--port", str(port), *flags]
    process = subprocess.Popen(
        [*cmd, "--workspace", str(workspace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    said = []
    for line in process.stdout:
        said.append(line)
        if "open http" in line:
            return process, line.split("open ", 1)[1].strip(), "".join(said)
    raise AssertionError(f"zerofit studio printed no URL: {''.join(said)}")


def wait_listening(server: Studio) -> None:
    """Until the server answers (uvicorn binds after the URL is printed)."""
    for _ in range(100):
        if server.request("/api/runs")[0] == 200:
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Studio]:
    """The studio server on a free localhost port, in a workspace with the demo's config and data."""
    workspace = tmp_path_factory.mktemp("studio-ws")
    (workspace / "configs").mkdir()
    for name in ("demo.yaml", "llama2-7b-full-zero3-offload-3090.yaml"):
        shutil.copy(REPO / "configs" / name, workspace / "configs" / name)
    shutil.copytree(REPO / "data", workspace / "data", ignore=shutil.ignore_patterns("*.png", "*.jpg"))
    process, url, _ = start_studio(workspace)
    assert url.startswith("http://127.0.0.1:") and "/?token=" in url, url
    server = Studio(url, workspace, process)
    wait_listening(server)
    yield server
    stop_jobs(server)
    process.terminate()
    process.wait(timeout=30)


def stop_jobs(server: Studio) -> None:
    """Stop what a failed test left running (a job outlives the studio: it runs in a session of its own)."""
    for _ in range(120):
        jobs = json.loads(server.request("/api/runs")[1])["jobs"]
        live = [j for j in jobs if j["state"] in ("queued", "running", "stopping")]
        if not live:
            return
        for job in live:
            if job["state"] != "stopping":
                server.request("/api/stop", {"job": job["id"]})
        time.sleep(1)


def test_another_interface_keeps_the_token_and_says_so(tmp_path: Path) -> None:
    process, url, said = start_studio(tmp_path, "--host", "0.0.0.0")
    try:
        assert "--host 0.0.0.0: the studio is reachable from other machines" in said
        assert "still needs the token" in said
        server = Studio(url, tmp_path, process)
        wait_listening(server)
        assert server.request("/api/runs", token=None)[0] == 403
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_requests_need_the_token_and_paths_stay_in_the_workspace(studio: Studio) -> None:
    """No request without the token succeeds (page, API, stream, static files); a path outside the workspace
    is refused with the studio's paragraph, whichever route names it."""
    for path in ("/", "/api/runs", "/api/options", "/static/studio.js", "/api/events?run=x"):
        status, text = studio.request(path, token=None)
        assert status == 403 and "carries no token" in text, (path, status, text)
        assert studio.request(path, token="not-the-token")[0] == 403
    assert studio.request("/api/plan", {"config": "configs/demo.yaml"}, token=None)[0] == 403
    assert studio.request("/api/runs")[0] == 200
    outside = [
        ("/api/file?path=/etc/passwd", None),
        ("/api/file?path=../../etc/passwd", None),
        ("/api/form?config=/etc/passwd", None),
        ("/api/events?run=/tmp", None),
        ("/api/compare", {"runs": ["/tmp"]}),
        ("/api/chat", {"model": "/etc", "prompt": "hi"}),
        ("/api/export", {"run": "../elsewhere", "kind": "adapter"}),
    ]
    for path, body in outside:
        status, text = studio.request(path, body)
        assert status == 403 and "is outside the studio's workspace" in text, (path, status, text)
    # The plan page's config picker: the same refusal, shown beside the config field.
    plan = json.loads(studio.request("/api/plan", {"config": "/etc/hosts"})[1])
    assert "is outside the studio's workspace" in plan["problems"]["config"][0]


def test_a_run_started_from_a_terminal_is_listed(studio: Studio) -> None:
    """A run folder the studio did not launch (config.yaml and metrics.jsonl, as a terminal's launch writes
    them) is listed with its progress, and as running while its rank 0 holds the run's lock."""
    import fcntl

    import yaml

    run = studio.workspace / "runs" / "from-terminal"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        yaml.safe_dump({"run_name": "from-terminal", "train": {"max_steps": 10}})
    )
    rows = [{"step": s, "loss": 3.0 - 0.1 * s, "step_time_s": 0.5} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def listed() -> dict[str, Any]:
        runs = json.loads(studio.request("/api/runs")[1])["runs"]
        return next(r for r in runs if r["run"] == "runs/from-terminal")

    with (run / ".zerofit.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the run's rank 0 holds it while it trains
        entry = listed()
    assert (entry["state"], entry["step"], entry["max_steps"], entry["eta_s"]) == ("running", 3, 10, 3.5)
    assert entry["job"] is None
    assert listed()["state"] == "stopped"  # the lock released, and no summary of a finished run


def test_one_queue_per_machine_and_one_launch_per_folder(studio: Studio) -> None:
    """While another job holds the machine's queue (another studio's run), a launch waits queued; a second
    launch into its folder is refused; Stop cancels it before anything starts."""
    import fcntl

    from zerofit.core.cache_dirs import cache_root
    from zerofit.studio.launches import QUEUE_LOCK

    form = json.loads(studio.request("/api/form?config=configs/demo.yaml")[1])["form"]
    form |= {"preset": "single", "overrides": ["run_name=queued", "logging.wandb.mode=disabled"]}
    lock_file = cache_root() / QUEUE_LOCK
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        job = json.loads(studio.request("/api/launch", form)[1])["job"]
        assert job["run"] == "runs/queued" and job["state"] == "queued"
        assert (studio.workspace / "runs" / "queued" / "config.yaml").is_file()  # written before the launch
        time.sleep(2)
        jobs = json.loads(studio.request("/api/runs")[1])["jobs"]
        assert next(j for j in jobs if j["id"] == job["id"])["state"] == "queued"
        status, text = studio.request("/api/resume", {"run": "runs/queued"})
        assert status == 400 and "already has a queued launch" in text, text
        stopped = json.loads(studio.request("/api/stop", {"job": job["id"]})[1])
        assert stopped["state"] == "cancelled" and stopped["pid"] is None


def not_blank(png: Path) -> None:
    """A screenshot with content: many colours and real contrast, not one flat colour."""
    from PIL import Image, ImageStat

    image = Image.open(png).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20) or []
    spread = max(ImageStat.Stat(image).stddev)
    assert len(colours) > 50 and spread > 15, f"{png.name}: {len(colours)} colours, stddev {spread:.1f}"


def browser_page(playwright: Any, user_data: Path) -> Any:
    """A fresh headless Chromium (its own profile, no network services) with one page."""
    context = playwright.chromium.launch_persistent_context(
        str(user_data),
        executable_path=str(CHROMIUM),
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": 1200, "height": 760},
    )
    return context, context.pages[0] if context.pages else context.new_page()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (.ci/run installs it)")
def test_browser_walk(studio: Studio, tmp_path: Path) -> None:
    """plan -> remedy -> launch tiny-llama -> loss appears -> stop -> resume -> compare -> chat -> export."""
    from playwright.sync_api import sync_playwright

    shots: list[Path] = []

    def shot(page: Any, name: str) -> None:
        path = tmp_path / f"{name}.png"
        page.screenshot(path=str(path))
        not_blank(path)
        shots.append(path)

    with sync_playwright() as playwright:
        context, page = browser_page(playwright, tmp_path / "profile")
        page.set_default_timeout(WAIT_MS)
        page.goto(studio.url)
        plan_and_remedy(page, shot)
        launch_watch_stop_resume(page, shot, studio)
        compare_and_chat(page, shot, studio)
        context.close()
    if os.environ.get("ZEROFIT_STUDIO_SCREENSHOTS") == "1":
        from PIL import Image

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        for path in shots:  # a 64-colour palette keeps the committed images small
            Image.open(path).convert("RGB").quantize(colors=64).save(SCREENSHOTS / path.name, optimize=True)


def verdict_after(page: Any, action: Callable[[], None]) -> str:
    """The verdict line once the plan that `action` asks for has come back (it differs from the one before)."""
    before = page.inner_text("#verdict")
    action()
    page.wait_for_function("b => document.querySelector('#verdict').innerText !== b", arg=before)
    return page.inner_text("#verdict")


def plan_and_remedy(page: Any, shot: Callable[[Any, str], None]) -> None:
    """A 7B full fine-tune on ZeRO-2 does not fit a 3090: the remedies come; one click applies one."""
    page.wait_for_function("document.querySelector('#verdict').innerText !== 'planning...'")
    verdict_after(
        page, lambda: page.select_option("#f-config", "configs/llama2-7b-full-zero3-offload-3090.yaml")
    )
    page.select_option("#f-gpu", "rtx3090")
    text = verdict_after(page, lambda: page.select_option("#f-preset", "zero2"))
    assert text.startswith("does not fit"), text
    page.wait_for_selector("#remedy-0")
    # The CLI's paragraph, beside the field it names.
    page.fill("#f-seq_len", "0")
    page.wait_for_function("document.querySelector('#e-seq_len').innerText.includes('data.max_seq_len')")
    page.fill("#f-seq_len", "1024")
    page.wait_for_function("document.querySelector('#e-seq_len').innerText === ''")
    page.wait_for_selector("#remedy-0")
    shot(page, "plan")
    lora = page.locator(".remedy", has_text="lora.enabled=true").first.locator("button")
    text = verdict_after(page, lora.click)
    assert text.startswith("fits"), text
    assert page.input_value("#f-method") == "lora"


def launch_watch_stop_resume(page: Any, shot: Callable[[Any, str], None], studio: Studio) -> None:
    """The tiny model from the page, watched until its loss shows, stopped, resumed, stopped again; a second
    launch into the running run's folder (another tab's Resume) is refused."""
    verdict_after(page, lambda: page.select_option("#f-config", "configs/demo.yaml"))
    page.select_option("#f-preset", "single")
    overrides = "train.max_steps=400\ntrain.precision=fp32\nlogging.wandb.mode=disabled\nrun_name=walk"
    page.fill("#f-overrides", overrides)
    page.wait_for_function("document.querySelector('#commands').innerText.includes('run_name=walk')")
    page.click("#launch")
    page.wait_for_selector("#page-runs.active")
    page.wait_for_function("Number(document.querySelector('#chart-main').dataset.points) >= 2")
    status, text = studio.request("/api/resume", {"run": "runs/walk"})
    assert status == 400 and "is running: stop it first" in text, (status, text)
    page.click("#stop:not([disabled])")
    page.wait_for_function("document.querySelector('#progress-text').dataset.state === 'stopped'")
    stopped_at = int(page.get_attribute("#chart-main", "data-points"))
    page.click("#resume:not([disabled])")
    page.wait_for_function(
        "n => Number(document.querySelector('#chart-main').dataset.points) > n + 1", arg=stopped_at
    )
    page.wait_for_function("document.querySelector('#log').innerText.includes('resumed from')")
    shot(page, "watch")
    page.click("#stop:not([disabled])")
    page.wait_for_function("document.querySelector('#progress-text').dataset.state === 'stopped'")


def compare_and_chat(page: Any, shot: Callable[[Any, str], None], studio: Studio) -> None:
    """`zerofit compare`'s table and plots of the run; the run and its base side by side in the chat; the
    adapter export button (`zerofit export runs/walk --out runs/walk/export-adapter`)."""
    page.click("#tab-compare")
    page.check("#compare-picks input[value='runs/walk']")
    page.click("#compare-go")
    page.wait_for_selector("#compare-plots img")
    page.wait_for_function("[...document.querySelectorAll('#compare-plots img')].every(i => i.complete)")
    assert "final loss" in page.inner_text("#compare-outcome")
    shot(page, "compare")
    page.click("#tab-chat")
    page.fill("#chat-model-a", "runs/walk")
    page.fill("#chat-model-b", "tiny-llama")
    page.fill("#chat-prompt", "reverse: abc")
    page.fill("#chat-temp", "0.8")
    page.click("#chat-send")
    page.wait_for_function("['a', 'b'].every(p => document.querySelector('#chat-out-' + p).dataset.done)")
    assert page.inner_text("#e-chat") == ""
    page.click("button.export[data-kind='adapter']")
    page.wait_for_function("document.querySelector('#exports').innerText.includes(': done')")
    assert (studio.workspace / "runs" / "walk" / "export-adapter" / "adapter_config.json").is_file()
    shot(page, "chat")
