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
# A figure of a shown line as the tolerance reads it: a sign, digits, a decimal part, an exponent. Only a
# decimal figure without an exponent (a loss, a reward, a mean) is compared within a fence's tolerance; a count,
# a step number, an lr in e-notation and every other token are compared as shown.
FIGURE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
DECIMAL = re.compile(r"-?\d+\.\d+")
# The tolerance a shown fence states after its language (```text ±0.01): how far each decimal figure of
# the command's real output may be from the shown one. A run in bf16 or fp16 needs one: its figures depend
# on the machine's kernels (AVX2, AVX512, AVX512-BF16 / AMX, each GPU), so no shown output encodes one CPU's
# rounding (docs/contracts.md, "Shown outputs").
TOLERANCE = re.compile(r"^±(\d+(?:\.\d+)?(?:e-?\d+)?)$")
# What says, in a command's real output, that it trained (a step line) in a half precision (the plan's engine
# line): its measured figures depend on the kernels. A plan alone (no step line) predicts, and is exact.
HALF_PRECISION = re.compile(r"\bprecision (?:bf16|fp16)\b")
TRAINED = re.compile(r"^step \d+/\d+ ", re.M)
# The plan's data line says when the tokenization cache was warm: whether an earlier run filled it.
WARM_CACHE = "; from the tokenization cache"
# Rules of a table border, as long as the widest cell: their length follows the numbers in it.
RULE = re.compile(r"([─━═┄]){2,}")


@dataclass(frozen=True)
class Shown:
    """A shown output (a ```text or plain fence): where it is, the command it names (`$ command` on its
    first line) or None when it is the output of the ```bash block right above it, its lines, and the
    tolerance its fence states for decimal figures (```text ±0.01), None where they are compared as shown."""

    doc: str
    line: int
    command: str | None
    lines: tuple[str, ...]
    tolerance: float | None = None

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


def _fences(text: str) -> Iterator[tuple[str, str, str, int, list[str], bool]]:
    """(heading, language, the rest of the fence's info string, first line, body, whether only blank lines
    separate it from the fence before)."""
    heading, language, info, body, start, adjacent, gap_blank = "top", "", "", [], 0, False, False
    for number, line, fence in outside_fences(text):
        if fence is None:
            heading = line.lstrip("#").strip() if line.startswith("#") else heading
            gap_blank = gap_blank and not line.strip()
        elif fence == "" and not start:
            language, _, info = (line.strip()[3:].strip() or "text").partition(" ")
            body, start, adjacent = [], number, gap_blank
        elif fence == "":
            yield heading, language, info.strip(), start, body, adjacent
            start, gap_blank = 0, True
        else:
            body.append(line)


def _tolerance(doc: str, line: int, info: str) -> float | None:
    """The tolerance a shown fence states (```text ±0.01), None when it states none; anything else after
    `text` is refused, so a misspelt tolerance is not read as none."""
    if not info:
        return None
    match = TOLERANCE.match(info)
    if match is None:
        raise ValueError(
            f"{doc}:{line}: a shown output's fence says {info!r}; the only word allowed after "
            "`text` is a tolerance for its decimal figures, such as ±0.01"
        )
    return float(match.group(1))


def _shown(doc: str, line: int, body: list[str], info: str = "") -> Shown:
    """A shown-output fence: `$ command` on its first line names what prints it."""
    tolerance = _tolerance(doc, line, info)
    if body and body[0].startswith("$ "):
        return Shown(doc, line, body[0][2:].strip(), tuple(body[1:]), tolerance)
    return Shown(doc, line, None, tuple(body), tolerance)


def doc_blocks(text: str, doc: str) -> list[Block]:
    """Every ```bash block of `text` (the document `doc`), its lines split into runnable and `# needs:` ones,
    with the output shown right below it."""
    blocks: list[Block] = []
    for heading, language, info, start, body, adjacent in _fences(text):
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
            blocks[-1] = replace(blocks[-1], shown=_shown(doc, start, body, info))
    return blocks


def shown_commands(text: str, doc: str) -> list[Shown]:
    """Every shown output of `text` that names its command (`$ command` first), wherever it stands."""
    shown = (
        _shown(doc, start, body, info)
        for _, language, info, start, body, _ in _fences(text)
        if language == "text"
    )
    return [s for s in shown if s.command is not None]


def all_shown(text: str, doc: str) -> list[Shown]:
    """Every shown output of `text`: the ```text fences, whether below a ```bash block or naming a command."""
    return [
        _shown(doc, start, body, info)
        for _, language, info, start, body, _ in _fences(text)
        if language == "text"
    ]


def _normal(line: str) -> str:
    """A line as compared: runs of blanks as one space, table rules one character long, the warm-cache
    remark left out (`WARM_CACHE`), and timings, speeds and measured memory masked as `#` (`VOLATILE`,
    `VOLATILE_NUMBER`)."""
    line = RULE.sub(r"\1", " ".join(line.split())).replace(WARM_CACHE, "")
    if "│" in line and VOLATILE.search(line):
        return NUMBER.sub("#", line)
    return VOLATILE_NUMBER.sub("#", line)


def _figures_match(want: str, got: str, tolerance: float) -> bool:
    """Whether `got` matches `want` as shown, but for decimal figures, each within `tolerance` of its own."""
    if want == got:
        return True
    if not (DECIMAL.fullmatch(want) and DECIMAL.fullmatch(got)):
        return False
    return abs(float(want) - float(got)) <= tolerance + 1e-12


def _line_starts(got: str, want: str, tolerance: float | None) -> bool:
    """Whether the real line `got` starts with the shown line `want`: exactly, or with every decimal figure
    within `tolerance` (the text between figures, and every other figure, still exactly)."""
    if got.startswith(want):
        return True
    if tolerance is None:
        return False
    want_text, got_text = FIGURE.split(want), FIGURE.split(got)
    want_figures, got_figures = FIGURE.findall(want), FIGURE.findall(got)
    if len(want_figures) > len(got_figures):
        return False
    last = len(want_figures)
    texts_agree = all(w == g for w, g in zip(want_text[:last], got_text, strict=False))
    tail_agrees = got_text[last].startswith(want_text[last]) if want_text[last] else True
    figures_agree = all(
        _figures_match(w, g, tolerance) for w, g in zip(want_figures, got_figures, strict=False)
    )
    return texts_agree and tail_agrees and figures_agree


def missing_shown(shown: tuple[str, ...], output: str, tolerance: float | None = None) -> str | None:
    """None when every shown line (`...` stands for any lines) starts a line of `output` (a shown line may
    stop early: a long plan line cut where the point is made), in the shown order, its decimal figures
    within `tolerance` where the fence states one; else the first shown line that does not, as compared."""
    actual = iter(_normal(line) for line in output.splitlines())
    for line in shown:
        want = _normal(line)
        if not want or want == ELISION:
            continue
        if not any(_line_starts(got, want, tolerance) for got in actual):
            return want
    return None


def exact_half_precision_figures(shown: Shown, output: str) -> list[str]:
    """The shown lines with a measured decimal figure compared exactly although `output` (the command's real
    output) is a training run in bf16 or fp16: each should sit in a fence that states a tolerance."""
    if shown.tolerance is not None or not (HALF_PRECISION.search(output) and TRAINED.search(output)):
        return []
    return [line for line in shown.lines if _measured(line) and DECIMAL.search(_normal(line))]


def _measured(line: str) -> bool:
    """Whether a shown line of a training run holds what the run measured (a step line, a summary row, the
    closing and best lines), not its plan: the plan's lines are indented under `zerofit plan` and predict."""
    return bool(line) and not line[0].isspace()


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
