"""The studio's guards, without a server: the token comparison and the workspace root (a symlink that leads
out counts as outside)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerofit.studio.security import OutsideWorkspace, Workspace, new_token, token_matches


def test_token_is_random_and_only_the_same_token_matches() -> None:
    token = new_token()
    assert len(token) >= 40 and token != new_token()
    assert token_matches(token, token)
    assert (
        not token_matches(None, token)
        and not token_matches("", token)
        and not token_matches(token[:-1], token)
    )


def test_paths_resolve_inside_the_workspace_and_are_refused_outside(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "runs").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path)
    workspace = Workspace(root)
    assert workspace.path("runs", "run") == (root / "runs").resolve()
    assert workspace.path(str(root / "runs"), "run") == (root / "runs").resolve()
    for outside in ("..", "/etc/passwd", "runs/../../x", "escape/other", "~"):
        with pytest.raises(OutsideWorkspace, match=r"is outside the studio's workspace"):
            workspace.path(outside, "run")


def test_a_model_field_is_a_name_or_a_folder_inside_the_workspace(tmp_path: Path) -> None:
    (tmp_path / "my-model").mkdir()
    workspace = Workspace(tmp_path)
    assert workspace.model("tiny-llama") == "tiny-llama"
    assert workspace.model("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    assert workspace.model("my-model") == str((tmp_path / "my-model").resolve())
    for outside in ("/opt/models/llama", "../llama", "~/llama"):
        with pytest.raises(OutsideWorkspace, match=r"model = .* is outside the studio's workspace"):
            workspace.model(outside)
