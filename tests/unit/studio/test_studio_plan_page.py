"""The studio's plan page shows `zerofit plan --json`'s own numbers: for every shipped config, the JSON API the
page reads (`/api/form`: the form as the file fills it, and its plan) returns the CLI's report unchanged, and
the stacked bar it draws adds up to the report's total, with the headroom the card's limit leaves."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zerofit.cli import main

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").glob("*.yaml"))
TOKEN = "t" * 43


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """The studio's app on the repository as its workspace, asked in this process (the token in a header)."""
    from fastapi.testclient import TestClient

    from zerofit.studio.security import Workspace
    from zerofit.studio.server import create_app

    with TestClient(create_app(TOKEN, Workspace(REPO)), headers={"X-Zerofit-Token": TOKEN}) as c:
        yield c


def cli_plan(config: str) -> dict[str, Any]:
    """`zerofit plan --config CONFIG --json`, parsed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--config", config, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_plan_page_numbers_equal_zerofit_plan_json(
    config: str, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the studio serves its workspace from there; `zerofit plan` runs there too
    page = client.get("/api/form", params={"config": config}).json()
    assert "error" not in page, page.get("error")
    assert page["report"] == cli_plan(config)
    memory, bars = page["report"]["memory"], page["bars"]
    assert sum(s["gib"] for s in bars["segments"]) == pytest.approx(memory["total_gib"], abs=1e-3)
    if memory.get("gpu"):
        limit = memory["gpu"]["limit_gib"]
        assert bars["headroom"] == pytest.approx(max(limit - memory["total_gib"], 0.0), abs=1e-3)
    # The commands shown are those of this plan: the file alone, no override the user did not make.
    assert page["commands"]["plan"] == f"zerofit plan --config {config} --world-size 1"
    assert page["overrides"] == []
