"""Every test module that launches trainings lists what it launches: its docstring's `launch  launcher ...`
table names each launch (or an fnmatch pattern of them) and the launcher that runs it.

tests/conftest.py checks, after each module's tests, that every launch the module started
(tests/launch_helpers.py records them) is a row of that table with its own launcher; here, the parsing that
check relies on, and that no launch module lacks a table (so the check has something to hold it to).
"""

from __future__ import annotations

import ast
from pathlib import Path

import launch_helpers
from launch_helpers import listed_launches, unlisted

TESTS = Path(__file__).resolve().parents[1]
TABLE = """What this module runs:

    launch      launcher    what
    single      api         the reference, a long description
                            that goes on here
    zero2-*     torchrun    each loss type's ZeRO-2 run

After the table.
"""


def _launch_modules() -> list[Path]:
    """Test modules that start a launch through tests/launch_helpers.py (its runners, or a `Launch`'s command)."""
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        calls = [node.func for node in ast.walk(tree) if isinstance(node, ast.Call)]
        names = {f.id for f in calls if isinstance(f, ast.Name)} | {
            f.attr for f in calls if isinstance(f, ast.Attribute)
        }
        if names & {"run_launches", "run_one", "run_in_process", "run_and_resume", "command"}:
            found.append(path)
    return found


def test_a_table_row_is_its_launch_pattern_and_launcher_and_continuations_are_not_rows() -> None:
    assert listed_launches(TABLE) == [("single", "api"), ("zero2-*", "torchrun")]


def test_a_launch_missing_from_the_table_or_run_by_another_launcher_is_reported(monkeypatch) -> None:
    ran = {("single", "api"), ("grpo-zero2", "torchrun"), ("grpo-fsdp", "torchrun"), ("zero2-x", "deepspeed")}
    monkeypatch.setitem(launch_helpers._launched, "/x/test_m.py", ran)
    assert unlisted("/x/test_m.py", TABLE) == [
        "grpo-fsdp (torchrun)",
        "grpo-zero2 (torchrun)",
        "zero2-x (deepspeed)",
    ]
    assert unlisted("/x/test_other.py", TABLE) == []  # launched nothing


def test_every_launch_module_has_a_launch_table() -> None:
    modules = _launch_modules()
    assert len(modules) >= 15, modules  # tests/distributed, the launch errors, the cache sources, ...
    missing = [
        str(p.relative_to(TESTS))
        for p in modules
        if not listed_launches(ast.get_docstring(ast.parse(p.read_text())) or "")
    ]
    assert missing == [], (
        f"launch modules without a `launch  launcher ...` table in their docstring: {missing}"
    )
