"""The repository's own docs stay true to the code and to each other: every config key of the schema is in
docs/contracts.md, every relative link resolves, the README stays short and every guide's blocks run."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from doc_blocks import (
    GUIDE_INDEX,
    GUIDES,
    LINK,
    README,
    REPO,
    Shown,
    all_blocks,
    all_shown,
    doc_blocks,
    documents,
    exact_half_precision_figures,
    guides_in_order,
    outside_fences,
)
from zerofit.config.rules.training import config_keys

# A shown line with a measured loss: a step line, the closing line, the best evaluation.
MEASURED = re.compile(r"\bloss\b.*\d\.\d")


def test_every_config_key_is_documented() -> None:
    contracts = (REPO / "docs" / "contracts.md").read_text()
    keys = config_keys()  # the schema's own list (sections and keys), as resolve() checks names against it
    leaves = [key for key in keys if not any(other.startswith(key + ".") for other in keys)]
    assert "optimizer.lr" in leaves and "optimizer" not in leaves
    missing = [key for key in leaves if f"`{key}`" not in contracts]
    assert not missing, f"config keys missing from docs/contracts.md: {missing}"


def test_docs_cite_only_what_is_in_the_repository() -> None:
    # Code, tests and docs cite docs/*.md, never notes outside the repository.
    for folder in ("src", "tests", "benchmarks", "launchers", "docs"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".sh") and path != Path(__file__):
                text = path.read_text()
                assert "../shared/" not in text and "DESIGN.md" not in text and "PLATFORM.md" not in text, (
                    path
                )


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of markdown file `path` (lower case, punctuation dropped)."""
    headings = [
        line for _, line, fence in outside_fences(path.read_text()) if fence is None and line.startswith("#")
    ]
    return {re.sub(r"[^\w\- ]", "", h.lstrip("#").strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves() -> None:
    # README.md and every doc link each other by relative paths (the README's sections moved to docs/guides/):
    # each must name a file that exists, and an #anchor into a markdown file must name one of its headings.
    pages = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        for number, line, fence in outside_fences(page.read_text()):
            for target, anchor in LINK.findall(line) if fence is None else ():
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                checked += 1
                path = (page.parent / target).resolve() if target else page
                if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                    broken.append(f"{page.relative_to(REPO)}:{number}: {target}#{anchor}".rstrip("#"))
    assert checked >= 30, checked  # the README's table and the guides' links were found
    assert not broken, f"relative links to no file or heading: {broken}"


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move the details to a guide in docs/guides/"
    first = next(block for block in doc_blocks(README.read_text(), "README.md"))
    assert first.heading.startswith("Quick start") and [c.split()[:2] for c in first.skipped] == [
        ["make", "demo"],
        ["make", "test"],
    ]


def test_every_guide_is_listed_so_its_blocks_run() -> None:
    # tests/e2e/test_readme.py runs the guides the index lists: a guide left out of it would never run.
    guides = {path for path in GUIDES.glob("*.md") if path != GUIDE_INDEX}
    assert len(guides) >= 10 and set(guides_in_order()) == guides, sorted(guides - set(guides_in_order()))
    readme = README.read_text()
    unlinked = [p.name for p in guides if f"(docs/guides/{p.name})" not in readme]
    assert "(docs/guides/README.md)" in readme and not unlinked, f"README.md links no {unlinked}"
    # No other doc has a ```bash block that nothing runs.
    for page in (REPO / "docs").rglob("*.md"):
        assert page.parent == GUIDES or not doc_blocks(page.read_text(), page.name), page


def test_no_block_was_lost_when_the_readme_moved_to_guides() -> None:
    # Counted on the README of 1,107 lines before its topics moved to docs/guides/: 15 ```bash blocks, 26
    # commands that run, 23 that say what they need. Every one still runs (or is skipped) from its new home.
    blocks = all_blocks()
    assert len(blocks) >= 15
    assert sum(len(b.commands) for b in blocks) >= 26
    assert sum(len(b.skipped) for b in blocks) >= 23


def _trains_in_half_precision(commands: tuple[str, ...]) -> bool:
    """Whether one of `commands` launches a training in bf16 or fp16: its `--config` file's
    `train.precision`, or a `train.precision=` override on the command line."""
    for command in commands:
        config = re.search(r"--config (\S+)", command)
        if "launch_finetune.py" not in command or config is None:
            continue
        override = re.search(r"\btrain\.precision=(\w+)", command)
        train = (yaml.safe_load((REPO / config.group(1)).read_text()) or {}).get("train") or {}
        if (override.group(1) if override else train.get("precision", "fp32")) in ("bf16", "fp16"):
            return True
    return False


def _shown_runs() -> list[tuple[Shown, tuple[str, ...]]]:
    """Every shown output of the README and the guides with the commands that print it."""
    pairs: list[tuple[Shown, tuple[str, ...]]] = [
        (block.shown, block.commands + block.skipped) for block in all_blocks() if block.shown is not None
    ]
    for path in documents():
        for shown in all_shown(path.read_text(), str(path.relative_to(REPO))):
            if shown.command is not None:
                pairs.append((shown, (shown.command,)))
    return pairs


def test_a_shown_half_precision_run_states_its_tolerance() -> None:
    """A shown output that is a training run in bf16 or fp16 (its plan's engine line says so, and it shows a
    step line) states how far its figures may differ on another machine (```text ±0.01): the 4th decimal of a
    bf16 loss differs between AVX2, AVX512 and AVX512-BF16 CPUs and between GPUs. tests/e2e/test_readme.py
    checks the same on the real output of every shown output it runs; this covers the ones it cannot run."""
    pairs = _shown_runs()
    assert len(pairs) >= 10 and any(_trains_in_half_precision(commands) for _, commands in pairs)
    exact = [
        f"{shown.doc}:{shown.line}"
        for shown, commands in pairs
        if shown.tolerance is None
        and (
            exact_half_precision_figures(shown, "\n".join(shown.lines))
            or (_trains_in_half_precision(commands) and any(MEASURED.search(line) for line in shown.lines))
        )
    ]
    assert not exact, f"bf16 / fp16 runs shown with exact figures (state a tolerance, ```text ±0.01): {exact}"
