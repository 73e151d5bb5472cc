"""`zerofit.core.lazy.hidden_unless_loaded`: an unloaded library is unimportable (and not found) inside the
block and importable again after it; a loaded one is left alone."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from zerofit.core.lazy import hidden_unless_loaded


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A tiny importable package, not imported yet."""
    name = "zerofit_lazy_probe"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_an_unloaded_library_is_hidden_in_the_block_and_back_after_it(library: str) -> None:
    with hidden_unless_loaded(library) as hidden:
        assert hidden
        assert importlib.util.find_spec(library) is None  # what "is it available" checks ask
        with pytest.raises(ImportError):
            importlib.import_module(library)
    assert library not in sys.modules
    assert importlib.import_module(library).VALUE == 1  # whoever needs it later imports it as usual


def test_a_loaded_library_is_left_alone(library: str) -> None:
    module = importlib.import_module(library)
    with hidden_unless_loaded(library) as hidden:
        assert not hidden
        assert importlib.import_module(library) is module
    assert sys.modules[library] is module


def test_the_library_comes_back_when_the_block_raises(library: str) -> None:
    with pytest.raises(RuntimeError), hidden_unless_loaded(library):
        raise RuntimeError("boom")
    assert importlib.import_module(library).VALUE == 1
