"""The chat page answers through `zerofit generate`'s generator: a built-in vision-language model reads an image
of the workspace, a language model given one gets the CLI's paragraph, and an image outside the workspace is
refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
TOKEN = "c" * 43


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """The studio's app on the repository, asked in this process."""
    from fastapi.testclient import TestClient

    from zerofit.studio.security import Workspace
    from zerofit.studio.server import create_app

    with TestClient(create_app(TOKEN, Workspace(REPO)), headers={"X-Zerofit-Token": TOKEN}) as c:
        yield c


@pytest.mark.slow
def test_chat_reads_an_image_with_a_vision_model_and_refuses_one_elsewhere(client: Any) -> None:
    image = next(p for p in sorted((REPO / "data" / "demo-vlm").rglob("*.png")))
    ask = {"prompt": "What colour is it?", "max_new_tokens": 4, "image": str(image.relative_to(REPO))}
    answer = client.post("/api/chat", json={**ask, "model": "tiny-qwen2-vl"})
    assert answer.status_code == 200 and isinstance(answer.json()["text"], str)
    refused = client.post("/api/chat", json={**ask, "model": "tiny-llama"})
    assert refused.status_code == 400
    assert "--image: this model is a language model" in refused.json()["error"]
    outside = client.post("/api/chat", json={**ask, "model": "tiny-qwen2-vl", "image": "/etc/hostname"})
    assert outside.status_code == 403 and "outside the studio's workspace" in outside.json()["error"]
    bad = client.post("/api/chat", json={**ask, "model": "tiny-llama", "image": "", "max_new_tokens": 0})
    # `zerofit generate`'s own paragraph (a flag's, so without "Invalid configuration")
    assert (bad.status_code, bad.json()["error"]) == (400, "--max-new-tokens 0: must be >= 1")
