"""Test names, docstrings and comments under tests/ say the property they check, not the number of the issue
or contract section that asked for it: a reader of a failure sees what broke without looking anything up.

Read as text (no import, no parse), so the whole tree takes milliseconds: a `def test_...` name holding an
issue or contract number, and a docstring-shaped string (one opening a line) or a `#` comment citing an issue
by number, are each listed as `file:line`.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
NUMBERED_NAME = re.compile(r"issue_?\d|contract_?\d", re.I)
TEST_NAME = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)", re.M)
DOCSTRING = re.compile(r'^[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.M | re.S)
COMMENT = re.compile(r"#[^\n]*")
CITES_ISSUE = re.compile(r"\bissue \d+", re.I)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _offenders(path: Path, root: Path = TESTS.parent) -> list[str]:
    """`file:line what` (file relative to `root`) for every numbered test name and every docstring or
    comment citing an issue."""
    text = path.read_text(encoding="utf-8")
    where = path.relative_to(root)
    out = [
        f"{where}:{_line(text, m.start(1))} test name {m.group(1)}"
        for m in TEST_NAME.finditer(text)
        if NUMBERED_NAME.search(m.group(1))
    ]
    docstrings = [(m.start(2), m.group(2)) for m in DOCSTRING.finditer(text)]
    comments = [(m.start(), m.group()) for m in COMMENT.finditer(text) if not _inside(m.start(), docstrings)]
    for start, body in docstrings + comments:
        for cite in CITES_ISSUE.finditer(body):
            out.append(f"{where}:{_line(text, start + cite.start())} cites {cite.group()!r}")
    return out


def _inside(offset: int, spans: list[tuple[int, str]]) -> bool:
    return any(start <= offset < start + len(body) for start, body in spans)


def test_no_test_name_or_docstring_cites_an_issue_number() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert files, f"no Python files under {TESTS}"
    offenders = [entry for path in files for entry in _offenders(path)]
    assert not offenders, (
        "say the property the test checks, not the issue or contract number that asked for it: "
        + "; ".join(offenders)
    )


def test_the_check_finds_a_numbered_name_a_docstring_and_a_comment(tmp_path: Path) -> None:
    """A planted file with each kind of offence is caught at each, and a plain string is left alone."""
    issue = "issue"  # spelled apart so this file's own text cites nothing
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        f'"""Module docstring citing {issue.title()} 45."""\n\n'
        "def test_run_directory_is_contract_3():\n"
        '    """Fine: says what it checks."""\n'
        f"    x = 1  # see {issue} 7\n\n"
        "def test_loss_falls_issue12():\n"
        f"    s = '{issue} 9 in a plain string is data, not a citation'\n"
    )
    assert _offenders(planted, tmp_path) == [
        "test_planted.py:3 test name test_run_directory_is_contract_3",
        "test_planted.py:7 test name test_loss_falls_issue12",
        "test_planted.py:1 cites 'Issue 45'",
        "test_planted.py:5 cites 'issue 7'",
    ]
