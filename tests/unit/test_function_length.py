"""No function in `src/zerofit` is longer than 60 lines (def line to last line, decorators excluded): long
functions are where a newcomer stalls; resolution reads as named steps, and each term the planner models
lands in one short place."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "zerofit"
MAX_LINES = 60


def _long_functions(path: Path) -> list[str]:
    """`file:line name (n lines)` for every function or method in `path` longer than MAX_LINES."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_LINES:
                out.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_no_function_longer_than_60_lines() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert files, f"no Python files under {SRC}"
    long = [entry for path in files for entry in _long_functions(path)]
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps): {long}"
