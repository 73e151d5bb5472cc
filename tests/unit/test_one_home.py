"""One home per fact: a name or number that several modules use is spelled once, in its home, and the
others import it. Each check reads the code of `src/zerofit/` (string constants, f-string pieces, constant
arithmetic, imports; never comments or docstrings, which may name the fact) and fails when an old
spelling comes back outside the home, naming the file and line.

- the checkpoint folder names `step-N`, `step-N.tmp`, `step-N.damaged`: `core/run_layout.py`
  (`step_dir_name` / `step_of_dir`, `saving_dir_name`, `STEP_DIR_GLOB`, `DAMAGED_SUFFIX`);
- the metrics fields `eval/loss`, `mem/rank{r}/<name>`, `mem/source`, `mem/max_peak_gib`:
  `metrics/keys.py` (`EVAL_LOSS`, `rank_field` / `rank_of_field`, `MEM_SOURCE`, `MAX_PEAK`);
- bytes in a GiB: `core/precision.py` (`GIB`);
- a nested config as dotted keys: `config/loader.py` (`flatten`), not the plotting module.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from zerofit.core.run_layout import DAMAGED_SUFFIX, STEP_DIR_GLOB, saving_dir_name, step_dir_name, step_of_dir
from zerofit.metrics.keys import PEAK_GIB, rank_field, rank_of_field

SRC = Path(__file__).resolve().parents[2] / "src" / "zerofit"
STEP_HOME = "core/run_layout.py"
KEYS_HOME = "metrics/keys.py"
GIB_HOME = "core/precision.py"
FLATTEN_HOME = "config/loader.py"

# A folder name being built or matched: `step-` right before an interpolation or the string's end
# (f"step-{n}"), a glob (`step-*`), a number (`step-4`) or a regex group (`step-(\d+)`). Prose such as
# "checkpoint step-N" in a help text is not a spelling of the name.
_STEP_NAME = re.compile(r"step-(?:$|[*\d(])")


@functools.cache
def _modules() -> dict[str, ast.Module]:
    """Every module of `src/zerofit/`, parsed once, by its path inside the package (`metrics/keys.py`)."""
    files = sorted(SRC.rglob("*.py"))
    assert files, f"no Python files under {SRC}"
    return {
        path.relative_to(SRC).as_posix(): ast.parse(path.read_text(), filename=str(path)) for path in files
    }


def _strings(tree: ast.Module) -> Iterator[ast.Constant]:
    """Every string constant of `tree`'s code, f-string pieces included; bare string statements (the
    docstrings) are documentation and left out."""
    docs = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def _spellings(predicate: Callable[[str], bool], home: str) -> list[str]:
    """`file:line 'text'` of every code string outside `home` for which `predicate(text)` holds."""
    return [
        f"{name}:{node.lineno} {node.value!r}"
        for name, tree in _modules().items()
        if name != home
        for node in _strings(tree)
        if predicate(node.value)
    ]


def test_the_checkpoint_folder_name_is_spelled_only_in_run_layout() -> None:
    found = _spellings(lambda text: bool(_STEP_NAME.search(text)) or DAMAGED_SUFFIX in text, STEP_HOME)
    assert not found, (
        "a checkpoint folder name is spelled outside run_layout.py; use step_dir_name / step_of_dir / "
        f"saving_dir_name / STEP_DIR_GLOB / DAMAGED_SUFFIX (or RunLayout.checkpoint): {found}"
    )


def test_the_step_folder_builder_and_parser_agree() -> None:
    assert step_of_dir(step_dir_name(40)) == 40
    assert step_of_dir(saving_dir_name(40)) is None  # a save in progress is not a checkpoint
    assert step_of_dir(step_dir_name(40) + DAMAGED_SUFFIX) is None
    assert step_of_dir("step-x") is None
    assert Path(step_dir_name(7)).match(STEP_DIR_GLOB) and Path(saving_dir_name(7)).match(STEP_DIR_GLOB)


def test_metrics_field_names_are_spelled_only_in_metrics_keys() -> None:
    names = {"eval/loss", "mem/source", "mem/max_peak_gib"}
    found = _spellings(lambda text: text in names or "mem/rank" in text, KEYS_HOME)
    assert not found, (
        "a metrics.jsonl field name shared between modules is spelled outside metrics/keys.py; import "
        "EVAL_LOSS / MEM_SOURCE / MAX_PEAK or build and parse per-rank names with rank_field / "
        f"rank_of_field: {found}"
    )


def test_the_per_rank_field_builder_and_parser_agree() -> None:
    # The name docs/contracts.md, metrics.jsonl, gives a rank's peak.
    assert rank_field(3, PEAK_GIB) == "mem/rank3/peak_gib"
    assert rank_of_field(rank_field(12, PEAK_GIB), PEAK_GIB) == 12
    assert rank_of_field(rank_field(1, "allocated_gib"), PEAK_GIB) is None
    assert rank_of_field("mem/max_peak_gib", PEAK_GIB) is None


def _constant_value(node: ast.AST) -> object:
    """The value of a numeric expression made of constants only (`1 << 30`, `2**30`, `1024 * 1024 * 1024`),
    else None."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"float", "int"}:
        return _constant_value(node.args[0]) if len(node.args) == 1 else None
    if isinstance(node, ast.BinOp):
        left, right = _constant_value(node.left), _constant_value(node.right)
        if left is None or right is None:
            return None
        ops = {ast.LShift: lambda a, b: a << b, ast.Pow: pow, ast.Mult: lambda a, b: a * b}
        op = ops.get(type(node.op))
        try:
            return op(left, right) if op else None
        except (TypeError, ValueError, OverflowError):  # `1 << -1`, a float shifted: not a size
            return None
    return None


def _gib_spellings(tree: ast.Module, where: str) -> list[str]:
    """`where:line text` of every `GIB = ...` and every constant expression worth 2**30 in `tree`."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AnnAssign) and any(
            isinstance(t, ast.Name) and t.id == "GIB" for t in targets
        ):
            found.append(f"{where}:{node.lineno} GIB =")
        elif isinstance(node, ast.BinOp | ast.Constant) and _constant_value(node) == 1 << 30:
            found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_bytes_in_a_gib_are_defined_only_in_precision() -> None:
    found = [
        entry for name, tree in _modules().items() if name != GIB_HOME for entry in _gib_spellings(tree, name)
    ]
    assert not found, (
        f"bytes in a GiB spelled outside precision.py; import GIB from zerofit.core.precision: {found}"
    )


def _flatten_problems(tree: ast.Module, name: str) -> list[str]:
    """Imports of `flatten` from the plotting module, and any `flatten` defined outside its home."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "zerofit.metrics.compare":
            if any(alias.name == "flatten" for alias in node.names):
                found.append(f"{name}:{node.lineno} imports flatten from the plotting module")
        elif isinstance(node, ast.FunctionDef) and node.name == "flatten" and name != FLATTEN_HOME:
            found.append(f"{name}:{node.lineno} defines another flatten")
    return found


def test_flatten_lives_in_the_config_loader() -> None:
    found = [entry for name, tree in _modules().items() for entry in _flatten_problems(tree, name)]
    assert not found, f"import flatten from zerofit.config.loader: {found}"


@pytest.mark.parametrize(
    "source",
    ['root / f"step-{n}"', 'root / f"step-{n}.tmp"', 'root.glob("step-*")', 're.compile(r"^step-(\\d+)$")'],
)
def test_the_step_check_catches_the_old_spellings(source: str) -> None:
    """The check above can fail: each old spelling, parsed as code, is caught."""
    assert any(_STEP_NAME.search(node.value) for node in _strings(ast.parse(source))), source


def test_prose_and_docstrings_are_not_spellings() -> None:
    source = '''"""Checkpoint `step-4` of f"step-{n}"."""\nhelp = "export checkpoint step-N, or `best`"\n'''
    assert not any(_STEP_NAME.search(node.value) for node in _strings(ast.parse(source)))


@pytest.mark.parametrize(
    "source", ["GIB = 2**30", "GIB: float = float(1 << 30)", "x = n / 1024**3", "y = n / 1073741824"]
)
def test_the_gib_check_catches_the_old_spellings(source: str) -> None:
    assert _gib_spellings(ast.parse(source), "example.py"), f"{source} not caught"
