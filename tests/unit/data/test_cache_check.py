"""A tokenization cache entry is checked against its source (`zerofit.data.cache_check`): a seeded
sample of records tokenized again must make the entry's units, whatever digest the entry carries. Every
loader that caches (SFT, preference pairs, KTO, image + text) is caught by it when the entry was rewritten
with a matching digest; a genuine entry is a hit with no note."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config_helpers import REPO
from zerofit.data import cache as cache_module
from zerofit.data import load_examples
from zerofit.data.cache_check import SAMPLE_SIZE, difference, sample_indices
from zerofit.data.preference import load_preference_pairs
from zerofit.data.records import open_source
from zerofit.data.unpaired import load_unpaired
from zerofit.models.tiny import ensure_tiny_llama

MISMATCH = "does not match its source ("


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_llama(0))


def _head(source: str, path: Path, n: int) -> Path:
    path.write_text("".join((REPO / "data" / source).read_text().splitlines(keepends=True)[:n]))
    return path


def test_the_sample_is_seeded_and_holds_the_first_and_the_last() -> None:
    assert sample_indices(range(SAMPLE_SIZE)) == list(range(SAMPLE_SIZE))  # few: all of them
    picked = sample_indices(range(0, 3000, 3))
    assert len(picked) == SAMPLE_SIZE and picked == sorted(set(picked))
    assert picked[0] == 0 and picked[-1] == 2997 and all(p % 3 == 0 for p in picked)
    assert sample_indices(range(0, 3000, 3)) == picked  # the same rows every time, on every rank
    assert sample_indices(range(1000)) == [i // 3 for i in picked]  # by position, whatever the numbers


def test_records_at_reads_the_records_iteration_numbers(tmp_path: Path) -> None:
    """Blank lines make no record in a JSONL file (they are skipped by number too); CSV takes the default
    reader; neither moves the progress counters."""
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"i": 0}\n\n{"i": 1}\n  \n{"i": 2}\n{"i": 3}\n')
    csv = tmp_path / "a.csv"
    csv.write_text("i\n0\n1\n2\n3\n")
    for path in (jsonl, csv):
        source = open_source(path)
        every = list(enumerate(source))
        counters = source.consumed, source.rows
        picked = list(source.records_at([0, 2, 3]))
        assert picked == [(i, *every[i][1]) for i in (0, 2, 3)]
        assert (source.consumed, source.rows) == counters


def test_difference_names_the_first_field_that_differs() -> None:
    from zerofit.data.pairs import PreferencePair
    from zerofit.data.sft import Example

    a = PreferencePair(Example([1, 2], [1, 2]), Example([1, 3], [-100, 3]), margin=1.0)
    assert (
        difference(a, PreferencePair(Example([1, 2], [1, 2]), Example([1, 3], [-100, 3]), margin=1.0)) is None
    )
    b = PreferencePair(Example([1, 2], [1, 2]), Example([1, 4], [-100, 4]), margin=1.0)
    assert difference(a, b) == "rejected.input_ids"
    assert difference(a, PreferencePair(a.chosen, a.rejected, margin=2.0)) == "margin"


def _remap_ids(entry: Path) -> None:
    """Every id through a seeded permutation of the ids the entry uses (all within the vocabulary)."""
    ids = np.load(entry / "input_ids.npy")
    permutation = np.random.default_rng(0).permutation(int(ids.max()) + 1).astype(np.int32)
    np.save(entry / "input_ids.npy", permutation[ids])


def _flip_labels(entry: Path) -> None:
    """KTO's labels (meta.json's `desirable`) all flipped: the ids stay right."""
    meta = json.loads((entry / "meta.json").read_text())
    meta["desirable"] = [not d for d in meta["desirable"]]
    (entry / "meta.json").write_text(json.dumps(meta))


def _fresh_digest(entry: Path) -> None:
    """meta.json's digest rewritten with zerofit's own function, to match whatever the entry now holds."""
    meta = json.loads((entry / "meta.json").read_text())
    claimed = {k: v for k, v in meta.items() if k != "digest"}
    meta["digest"] = cache_module._content_digest(entry, claimed)
    (entry / "meta.json").write_text(json.dumps(meta))


def _documents(path: Path) -> Path:
    """Text documents, each cut into several examples at max_seq_len 16."""
    path.write_text("".join(json.dumps({"text": f"document {i} " * (5 + i)}) + "\n" for i in range(12)))
    return path


def _demo(name: str) -> Callable[[Path], Path]:
    return lambda path: _head(name, path, 40)


def _sft(path: Path, tok: Any) -> Any:
    return load_examples(path, tok, 64, cache=True)


def _kto(path: Path, tok: Any) -> Any:
    return load_unpaired(path, tok, 64, cache=True)


# case: (write the data, load it through the cache, poison the entry, the field the note names)
LOADERS: dict[str, tuple[Callable[[Path], Path], Callable[[Path, Any], Any], Callable[[Path], None], str]] = {
    "sft": (_demo("demo.jsonl"), _sft, _remap_ids, "input_ids"),
    "text documents": (_documents, lambda p, t: load_examples(p, t, 16, cache=True), _remap_ids, "input_ids"),
    "preference": (
        _demo("demo_preference.jsonl"),
        lambda p, t: load_preference_pairs(p, t, 64, cache=True),
        _remap_ids,
        "chosen.input_ids",
    ),
    "kto ids": (_demo("demo_kto.jsonl"), _kto, _remap_ids, "example.input_ids"),
    "kto labels": (_demo("demo_kto.jsonl"), _kto, _flip_labels, "desirable"),
}


@pytest.mark.parametrize("case", list(LOADERS))
def test_an_entry_rewritten_with_a_matching_digest_is_tokenized_again(
    case: str, tok: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    write, load, poison, field = LOADERS[case]
    path = write(tmp_path / "data.jsonl")
    first = load(path, tok)
    hit = load(path, tok)
    assert hit.stats.from_cache and capsys.readouterr().err == ""  # a genuine entry: a hit, no note
    (entry,) = (tmp_path / "cache" / "tokenized").iterdir()
    poison(entry)
    _fresh_digest(entry)
    assert cache_module.entry_problem(entry, len(tok)) is None  # what the digest-era checks say: sound
    rebuilt = load(path, tok)
    assert not rebuilt.stats.from_cache
    assert (rebuilt.examples, rebuilt.records) == (first.examples, first.records)
    err = capsys.readouterr().err
    assert err.startswith(f"zerofit: {entry} {MISMATCH}") and err.endswith("; rebuilding it\n"), err
    assert f"record 0 of {path}, tokenized again, differs in example 0's {field}" in err
    assert err.count("\n") == 1
    again = load(path, tok)  # the rebuilt entry serves the next load
    assert again.stats.from_cache and again.examples == first.examples and capsys.readouterr().err == ""
