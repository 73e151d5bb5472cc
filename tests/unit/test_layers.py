"""The import structure of `src/zerofit/` against the layer table in docs/architecture.md: no import from a
lower layer to a higher one, and no files that import each other in a circle (every import counts: module
level, inside functions, and under TYPE_CHECKING)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "zerofit"


def _layer_table() -> dict[str, int]:
    """`path relative to src/zerofit` (a file, or a folder ending in /) -> layer, from the docs' block."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    table: dict[str, int] = {}
    for line in block.group(1).splitlines():
        if line.strip():
            layer, *entries = line.split()
            table.update(dict.fromkeys(entries, int(layer)))
    return table


def _layer_of(path: Path, table: dict[str, int]) -> int:
    rel = path.relative_to(SRC).as_posix()
    if rel in table:
        return table[rel]
    folder = rel.split("/")[0] + "/"
    if folder in table:
        return table[folder]
    raise AssertionError(f"src/zerofit/{rel} is in no layer of docs/architecture.md")


def _module_file(module: str) -> Path | None:
    """The file of a `zerofit.*` module (a package's __init__.py for a package)."""
    parts = module.split(".")[1:]
    base = SRC.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imports(path: Path) -> set[Path]:
    """Files of `src/zerofit` that `path` imports, anywhere in it."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name == "zerofit" or name.startswith("zerofit."):
                target = _module_file(name)
                if target is not None and target != path:
                    found.add(target)
    return found


FILES = sorted(SRC.rglob("*.py"))
GRAPH = {path: _imports(path) for path in FILES}


def test_every_module_has_a_layer() -> None:
    table = _layer_table()
    for path in FILES:
        _layer_of(path, table)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(SRC).as_posix())
def test_no_import_runs_up_a_layer(path: Path) -> None:
    table = _layer_table()
    mine = _layer_of(path, table)
    upward = {
        target.relative_to(SRC).as_posix(): _layer_of(target, table)
        for target in GRAPH[path]
        if _layer_of(target, table) > mine
    }
    assert not upward, f"layer {mine} imports from higher layers: {upward}"


def test_no_circles() -> None:
    state: dict[Path, str] = {}
    stack: list[Path] = []

    def visit(node: Path) -> None:
        state[node] = "open"
        stack.append(node)
        for target in GRAPH[node]:
            if state.get(target) == "open":
                loop = [p.relative_to(SRC).as_posix() for p in stack[stack.index(target) :]]
                raise AssertionError(f"import circle: {' -> '.join([*loop, loop[0]])}")
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for path in FILES:
        if path not in state:
            visit(path)


TOP_MODULES = {"__init__.py", "api.py", "cli.py", "version.py"}


def test_no_module_is_loose_at_the_top() -> None:
    """Every module lives in the package of its role; the top holds only the package root, the API, the CLI
    and the version (docs/architecture.md, "Packages by role")."""
    loose = {path.name for path in SRC.glob("*.py")} - TOP_MODULES
    assert not loose, f"modules loose at the top of src/zerofit/: {sorted(loose)}: move each into its package"


def test_the_tree_has_at_most_30_parts() -> None:
    """Counting each package and each top-level module once, the import graph stays small enough to read."""
    packages = {path.name for path in SRC.iterdir() if (path / "__init__.py").is_file()}
    assert len(packages) + len(TOP_MODULES) <= 30, sorted(packages)
