"""The repository's own docs stay true to the code: every config key of the schema is in docs/contracts.md."""

from __future__ import annotations

from pathlib import Path

from zerofit.config.resolve import config_keys

REPO = Path(__file__).resolve().parents[2]


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
