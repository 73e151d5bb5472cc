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
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
GUIDES = REPO / "docs" / "guides"
GUIDE_INDEX = GUIDES / "README.md"
NEEDS = re.compile(r"#.*\bneeds:\s*(\S.*)?$")
# [text](target) and ![alt](target): the target up to an optional #anchor.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]*)(?:#([^)\s]*))?\)")


# A line of shown output that stands for any number of lines of the real output.
ELISION = "..."
# What differs from run to run and machine to machine, and is masked before comparing: timings, speeds and
# measured memory. A table row (it has `│`) naming one of them has all its numbers masked; on another line
# only the number of the timing, speed or memory itself (a step line's loss is still compared). A plan's
# predicted GiB, a loss and a count are compared as shown.
VOLATILE = re.compile(r"tok/s|tokens/s|wall time|\beta\b|\bpeak\b|cpu_rss")
VOLATILE_NUMBER = re.compile(
    r"\d[\d,]*(?:\.\d+)?(?= ?(?:tok/s|tokens/s|s\b))|(?<=\beta )\S+|(?<=\bpeak )\d+(?:\.\d+)?(?= GiB)"
)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# The plan's data line says when the tokenization cache was warm: whether an earlier run filled it.
WARM_CACHE = "; from the tokenization cache"
# Rules of a table border, as long as the widest cell: their length follows the numbers in it.
RULE = re.compile(r"([─━═┄]){2,}")


@dataclass(frozen=True)
class Shown:
    """A shown output (a ```text or plain fence): where it is, the command it names (`$ command` on its
    first line) or None when it is the output of the ```bash block right above it, and its lines."""

    doc: str
    line: int
    command: str | None
    lines: tuple[str, ...]

    @property
    def id(self) -> str:
        """A test id naming the document and the line."""
        stem = Path(self.doc).stem if self.doc.startswith("docs/") else "README"
        return f"{stem}-L{self.line}-shown"


@dataclass(frozen=True)
class Block:
    """One ```bash block: its document, where it is, the commands that run and the ones that say what they
    need, and the output shown right below it (a ```text block after nothing but blank lines), if any."""

    doc: str
    heading: str
    line: int
    commands: tuple[str, ...]
    skipped: tuple[str, ...]
    shown: Shown | None = None

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


def _fences(text: str) -> Iterator[tuple[str, str, int, list[str], bool]]:
    """(heading, language, first line, body, whether only blank lines separate it from the fence before)."""
    heading, language, body, start, adjacent, gap_blank = "top", "", [], 0, False, False
    for number, line, fence in outside_fences(text):
        if fence is None:
            heading = line.lstrip("#").strip() if line.startswith("#") else heading
            gap_blank = gap_blank and not line.strip()
        elif fence == "" and not start:
            language, body, start, adjacent = line.strip()[3:].strip() or "text", [], number, gap_blank
        elif fence == "":
            yield heading, language, start, body, adjacent
            start, gap_blank = 0, True
        else:
            body.append(line)


def _shown(doc: str, line: int, body: list[str]) -> Shown:
    """A shown-output fence: `$ command` on its first line names what prints it."""
    if body and body[0].startswith("$ "):
        return Shown(doc, line, body[0][2:].strip(), tuple(body[1:]))
    return Shown(doc, line, None, tuple(body))


def doc_blocks(text: str, doc: str) -> list[Block]:
    """Every ```bash block of `text` (the document `doc`), its lines split into runnable and `# needs:` ones,
    with the output shown right below it."""
    blocks: list[Block] = []
    for heading, language, start, body, adjacent in _fences(text):
        if language == "bash":
            commands = _logical_lines(body)
            skipped = tuple(c for c in commands if NEEDS.search(c))
            blocks.append(Block(doc, heading, start, tuple(c for c in commands if c not in skipped), skipped))
        elif (
            language == "text"
            and adjacent
            and blocks
            and blocks[-1].shown is None
            and blocks[-1].line < start
        ):
            blocks[-1] = replace(blocks[-1], shown=_shown(doc, start, body))
    return blocks


def shown_commands(text: str, doc: str) -> list[Shown]:
    """Every shown output of `text` that names its command (`$ command` first), wherever it stands."""
    shown = (_shown(doc, start, body) for _, language, start, body, _ in _fences(text) if language == "text")
    return [s for s in shown if s.command is not None]


def _normal(line: str) -> str:
    """A line as compared: runs of blanks as one space, table rules one character long, the warm-cache
    remark left out (`WARM_CACHE`), and timings, speeds and measured memory masked as `#` (`VOLATILE`,
    `VOLATILE_NUMBER`)."""
    line = RULE.sub(r"\1", " ".join(line.split())).replace(WARM_CACHE, "")
    if "│" in line and VOLATILE.search(line):
        return NUMBER.sub("#", line)
    return VOLATILE_NUMBER.sub("#", line)


def missing_shown(shown: tuple[str, ...], output: str) -> str | None:
    """None when every shown line (`...` stands for any lines) starts a line of `output` (a shown line may
    stop early: a long plan line cut where the point is made), in the shown order; else the first shown
    line that does not, as it was compared."""
    actual = iter(_normal(line) for line in output.splitlines())
    for line in shown:
        want = _normal(line)
        if not want or want == ELISION:
            continue
        if not any(got.startswith(want) for got in actual):
            return want
    return None


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


def all_shown_commands() -> list[Shown]:
    """Every shown output of the README and the guides that names its command, in document order."""
    return [
        shown
        for path in documents()
        for shown in shown_commands(path.read_text(), str(path.relative_to(REPO)))
    ]


def all_blocks() -> list[Block]:
    """Every ```bash block of the README and the guides, in the order they run."""
    return [
        block for path in documents() for block in doc_blocks(path.read_text(), str(path.relative_to(REPO)))
    ]
