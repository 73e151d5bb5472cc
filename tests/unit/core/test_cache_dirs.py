"""One cache location whoever launches: `make demo` and a hand-typed launch resolve the same folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerofit.core.cache_dirs import EXTENSIONS_ENV, cache_root, extensions_dir, use_cache_defaults

REPO = Path(__file__).resolve().parents[3]


def test_defaults_sit_under_one_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ZEROFIT_CACHE", raising=False)
    monkeypatch.delenv(EXTENSIONS_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "zerofit"
    assert use_cache_defaults() == tmp_path / ".cache" / "zerofit" / "torch_extensions"
    assert os.environ[EXTENSIONS_ENV] == str(tmp_path / ".cache" / "zerofit" / "torch_extensions")
    monkeypatch.setenv(EXTENSIONS_ENV, str(tmp_path / "mine"))
    assert use_cache_defaults() == extensions_dir() == tmp_path / "mine"  # an exported folder is kept


def _make_env(home: Path) -> dict[str, str]:
    """The environment `make demo`'s recipes get (make -n prints nothing of it: ask make to echo it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROFIT_CACHE", EXTENSIONS_ENV, "MAKEFLAGS")}
    env["HOME"] = str(home)
    probe = (
        "include Makefile\n"
        "zerofit-cache-probe:\n"
        '\t@echo "ZEROFIT_CACHE=$$ZEROFIT_CACHE"; echo "TORCH_EXTENSIONS_DIR=$$TORCH_EXTENSIONS_DIR"\n'
    )
    out = subprocess.run(
        ["make", "-s", "-f", "-", "zerofit-cache-probe"],
        input=probe,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    made = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return {**env, **{k: v for k, v in made.items() if v}}


@pytest.mark.skipif(sys.platform != "linux", reason="make and bash as on the CI machine")
def test_a_hand_typed_launch_finds_the_caches_make_demo_filled(tmp_path: Path) -> None:
    # What each side resolves in its own process, as the launch resolves it (before DeepSpeed compiles).
    code = "from zerofit.core.cache_dirs import cache_root, use_cache_defaults; print(cache_root(), use_cache_defaults())"
    hand = {k: v for k, v in os.environ.items() if k not in ("ZEROFIT_CACHE", EXTENSIONS_ENV)}
    hand["HOME"] = str(tmp_path)
    seen = [
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        for env in (_make_env(tmp_path), hand)
    ]
    assert seen[0] == seen[1] == f"{tmp_path}/.cache/zerofit {tmp_path}/.cache/zerofit/torch_extensions\n"
