"""The documents whose ```bash blocks the tests run, and those blocks: README.md, then docs/guides/*.md.

The order is the one tests/e2e/test_readme.py runs them in: the README first, then the guides in the order
the guides' index (docs/guides/README.md) lists them, because a later block may use what an earlier one made
(the export guide reads `runs/one`, which the README's tour trains). tests/unit/test_docs.py checks that
every guide is in that index, so no guide's blocks are left out. Markdown headings and links are read here
too, for the link check of test_docs.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
GUIDES = REPO / "docs" / "guides"
GUIDE_INDEX = GUIDES / "README.md"
NEEDS = re.compile(r"#.*\bneeds:\s*(\S.*)?$")
# [text](target) and ![alt](target): the target up to an optional #anchor.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]*)(?:#([^)\s]*))?\)")


@dataclass(frozen=True)
class Block:
    """One ```bash block: its document, where it is, the commands that run and the ones that say what they need."""

    doc: str
    heading: str
    line: int
    commands: tuple[str, ...]
    skipped: tuple[str, ...]

    @property
    def id(self) -> str:
        """A test id naming the document (README, or the guide's stem), the line and the heading."""
        stem = Path(self.doc).stem if self.doc.startswith("docs/") else "README"
        return f"{stem}-L{self.line}-{re.sub(r'[^a-z0-9]+', '-', self.heading.lower()).strip('-')}"


def _logical_lines(lines: list[str]) -> list[str]:
    """Shell lines with `\\` continuations joined, blank and comment-only lines left out."""
    out: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return [line for line in out if line.strip() and not line.lstrip().startswith("#")]


def outside_fences(text: str) -> Iterator[tuple[int, str, str | None]]:
    """(line number, line, the fence's language or None) for every line; a fence's own lines have language ''.

    A `#` line inside a fence (a shell comment, a Modelfile) is no heading, and a link there is no link.
    """
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = stripped[3:].strip() or "text"
            yield number, line, ""
        elif fence is not None and stripped == "```":
            fence = None
            yield number, line, ""
        else:
            yield number, line, fence


def doc_blocks(text: str, doc: str) -> list[Block]:
    """Every ```bash block of `text` (the document `doc`), its lines split into runnable and `# needs:` ones."""
    blocks: list[Block] = []
    heading, body, start = "top", [], 0
    for number, line, fence in outside_fences(text):
        if fence is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif fence == "" and line.strip() == "```bash":
            body, start = [], number
        elif fence == "bash":
            body.append(line)
        elif fence == "" and line.strip() == "```" and start:
            commands = _logical_lines(body)
            skipped = tuple(c for c in commands if NEEDS.search(c))
            blocks.append(Block(doc, heading, start, tuple(c for c in commands if c not in skipped), skipped))
            body, start = [], 0
    return blocks


def guides_in_order() -> list[Path]:
    """The guides as docs/guides/README.md lists them (each once, in its order)."""
    guides: list[Path] = []
    for _, line, fence in outside_fences(GUIDE_INDEX.read_text()):
        for target, _anchor in LINK.findall(line) if fence is None else ():
            path = (GUIDES / target).resolve()
            if path.parent == GUIDES and path.suffix == ".md" and path != GUIDE_INDEX and path not in guides:
                guides.append(path)
    return guides


def documents() -> list[Path]:
    """README.md, then every guide, in the order their blocks run."""
    return [README, *guides_in_order()]


def all_blocks() -> list[Block]:
    """Every ```bash block of the README and the guides, in the order they run."""
    return [
        block for path in documents() for block in doc_blocks(path.read_text(), str(path.relative_to(REPO)))
    ]
