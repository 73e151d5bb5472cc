"""Data sources: the same records from JSONL, JSON, CSV/TSV, Parquet, a `save_to_disk` folder and a hub dataset id
(loaded offline from a `datasets` cache laid out as an online load leaves it) give the same examples; the
tokenization cache; held-out evaluation splits; and the config checks of the data keys."""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config_helpers import DEMO_DATA
from zerofit.config import load_config
from zerofit.core.errors import ConfigError, DataError
from zerofit.data import cache as cache_module
from zerofit.data import hold_out, load_examples
from zerofit.data import sft as sft_module
from zerofit.data.preference import load_preference_pairs
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.resolution import resolve

PAIRS = [{"prompt": f"q{i}: {'ab' * (i % 5)}", "response": f"a{i}"} for i in range(12)]
CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"hi {i}"},
            {"role": "assistant", "content": "x" * (i % 4 + 1)},
        ]
    }
    for i in range(6)
]


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_llama(0))


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _dataset(records: list[dict[str, Any]]) -> Any:
    import datasets

    return datasets.Dataset.from_list(records)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `datasets` cache holding hub dataset `zerofit-test/pairs` (splits train, test) as an online
    `load_dataset` leaves it: `<cache>/<org>___<name>/<config>/<version>/<revision>/` with the Arrow files
    and dataset_info.json, written by the same JSON builder the hub loader uses."""
    from datasets.packaged_modules.json.json import Json

    root = tmp_path_factory.mktemp("hub")
    train, test = _jsonl(root / "train.jsonl", PAIRS), _jsonl(root / "test.jsonl", PAIRS[:3])
    builder = Json(
        cache_dir=str(root / "build"),
        dataset_name="pairs",
        data_files={"train": str(train), "test": str(test)},
    )
    builder.download_and_prepare()
    revision = root / "cache" / "zerofit-test___pairs" / "default" / "0.0.0" / "0123456789abcdef"
    revision.parent.mkdir(parents=True)
    shutil.move(builder.cache_dir, revision)
    return root / "cache"


@pytest.fixture
def offline_hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hub_cache)
    assert datasets.config.HF_HUB_OFFLINE  # tests run offline (conftest): only the cache can answer
    return hub_cache


# ---------------------------------------------------------------- one set of records, every source


def _write_sources(folder: Path) -> dict[str, str]:
    _jsonl(folder / "pairs.jsonl", PAIRS)
    (folder / "pairs.json").write_text(json.dumps(PAIRS, indent=1))
    _jsonl(folder / "lines.json", PAIRS)  # JSON lines under a .json name
    for name, delimiter in (("pairs.csv", ","), ("pairs.tsv", "\t")):
        with (folder / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, ["prompt", "response"], delimiter=delimiter)
            writer.writeheader()
            writer.writerows(PAIRS)
    _dataset(PAIRS).to_parquet(str(folder / "pairs.parquet"))
    _dataset(PAIRS).save_to_disk(str(folder / "saved"))
    import datasets

    datasets.DatasetDict({"train": _dataset(PAIRS), "test": _dataset(PAIRS[:3])}).save_to_disk(
        str(folder / "dict")
    )
    return {
        name: str(folder / name)
        for name in ("pairs.json", "lines.json", "pairs.csv", "pairs.tsv", "pairs.parquet", "saved", "dict")
    }


def test_every_source_gives_the_same_examples(tmp_path: Path, tok: Any, offline_hub: Path) -> None:
    sources = _write_sources(tmp_path)
    reference = load_examples(tmp_path / "pairs.jsonl", tok, 64)
    sources["hub"] = "zerofit-test/pairs"
    for name, path in sources.items():
        data = load_examples(path, tok, 64)
        assert data.examples == reference.examples, name
        assert (data.stats.n_lines, data.stats.format) == (12, "prompt_response"), name
    kinds = {name: load_examples(path, tok, 64).stats.source for name, path in sources.items()}
    assert "Parquet file" in kinds["pairs.parquet"] and "save_to_disk folder" in kinds["saved"]
    assert kinds["hub"] == "zerofit-test/pairs (hub dataset, split 'train')"


def test_splits_of_a_saved_dataset_dict_and_a_hub_dataset(
    tmp_path: Path, tok: Any, offline_hub: Path
) -> None:
    sources = _write_sources(tmp_path)
    test_pairs = load_examples(_jsonl(tmp_path / "t.jsonl", PAIRS[:3]), tok, 64).examples
    assert load_examples(sources["dict"], tok, 64, split="test").examples == test_pairs
    assert load_examples("zerofit-test/pairs", tok, 64, split="test").examples == test_pairs
    with pytest.raises(DataError, match=r"has no split 'valid' \(splits: 'train', 'test'\)"):
        load_examples(sources["dict"], tok, 64, split="valid")
    with pytest.raises(DataError, match=r"zerofit-test/pairs.*valid.*data\.split"):
        load_examples("zerofit-test/pairs", tok, 64, split="valid")


def test_chat_records_from_parquet_and_save_to_disk(tmp_path: Path, tok: Any) -> None:
    reference = load_examples(_jsonl(tmp_path / "c.jsonl", CHATS), tok, 64).examples
    _dataset(CHATS).to_parquet(str(tmp_path / "c.parquet"))
    _dataset(CHATS).save_to_disk(str(tmp_path / "c-saved"))
    assert load_examples(tmp_path / "c.parquet", tok, 64).examples == reference
    assert load_examples(tmp_path / "c-saved", tok, 64).examples == reference


def test_a_hub_dataset_neither_cached_nor_reachable(tok: Any, offline_hub: Path) -> None:
    with pytest.raises(DataError) as err:
        load_examples("zerofit-test/not-there", tok, 64, key="data.eval_path")
    msg = str(err.value)
    assert msg.startswith("data.eval_path = 'zerofit-test/not-there' is not a local file or folder")
    assert "HF_HUB_OFFLINE" in msg and "cache" in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("bad.csv", 'prompt,response\n"a","b","c"\n', "bad.csv:2: more cells than the header's 2 columns"),
        ("bad.parquet", "not parquet", "bad.parquet: not a readable Parquet file"),
        ("bad.json", '[{"prompt": "a", "response": "b"},\n oops]', "bad.json:2: invalid JSON"),
        ("scalars.json", "[1, 2]", "scalars.json item 0: expected a JSON object"),
    ],
)
def test_bad_files_name_the_place(tmp_path: Path, tok: Any, name: str, content: str, needle: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError) as err:
        load_examples(tmp_path / name, tok, 64)
    assert needle in str(err.value)


def test_a_folder_that_is_no_saved_dataset(tmp_path: Path, tok: Any) -> None:
    with pytest.raises(DataError, match=r"is a folder but not one written by `datasets` save_to_disk"):
        load_examples(tmp_path, tok, 64)


# ---------------------------------------------------------------- tokenization cache


def test_the_cache_serves_a_second_load_without_tokenizing(
    tmp_path: Path, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    chats = _jsonl(tmp_path / "c.jsonl", CHATS)
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "abcdefgh" * 20}])
    first = [load_examples(p, tok, 64, cache=True) for p in (chats, text)]
    assert not any(d.stats.from_cache for d in first)

    def refuse(*_: Any) -> None:
        raise AssertionError("tokenized again")

    real = sft_module._tokenize_source
    monkeypatch.setattr(sft_module, "_tokenize_source", refuse)
    again = [load_examples(p, tok, 64, cache=True) for p in (chats, text)]
    for before, after in zip(first, again, strict=True):
        assert after.stats.from_cache
        assert after.examples == before.examples and after.records == before.records
        assert {**vars(after.stats), "from_cache": False} == vars(before.stats)
    # Anything that changes the tokens is a new key: the content, max_seq_len, the tokenizer's template.
    monkeypatch.setattr(sft_module, "_tokenize_source", real)
    _jsonl(chats, CHATS[:3])
    assert not load_examples(chats, tok, 64, cache=True).stats.from_cache
    assert not load_examples(chats, tok, 32, cache=True).stats.from_cache
    tok_copy = type(tok).from_pretrained(ensure_tiny_llama(0))
    tok_copy.chat_template = tok.chat_template.replace("a: ", "b: ")
    assert not load_examples(chats, tok_copy, 64, cache=True).stats.from_cache
    assert load_examples(chats, tok, 64, cache=True).stats.from_cache
    entries = list((tmp_path / "cache" / "tokenized").iterdir())
    assert len(entries) == 5 and not [e for e in entries if e.name.startswith(".")]  # no temporary left


def test_a_broken_cache_entry_is_replaced_once_not_retokenized_on_every_run(
    tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    chats = _jsonl(tmp_path / "c.jsonl", CHATS)
    first = load_examples(chats, tok, 64, cache=True)
    (entry,) = (tmp_path / "cache" / "tokenized").iterdir()
    (entry / "offsets.npy").write_bytes(b"truncated")  # a disk that filled up, a copy that was cut short
    rebuilt = load_examples(chats, tok, 64, cache=True)
    assert not rebuilt.stats.from_cache and rebuilt.examples == first.examples
    assert f"tokenization cache entry {entry} could not be read" in capsys.readouterr().err
    again = load_examples(chats, tok, 64, cache=True)  # the replacement serves the next run
    assert again.stats.from_cache and again.examples == first.examples
    assert [e.name for e in entry.parent.iterdir()] == [entry.name]  # nothing set aside is left


def _edit_array(entry: Path, name: str, edit: Callable[[np.ndarray], np.ndarray]) -> None:
    """Rewrite `entry/name.npy` as `edit` returns it (a loadable file whose digest is now stale)."""
    np.save(entry / f"{name}.npy", edit(np.load(entry / f"{name}.npy")))


def _set(array: np.ndarray, index: int, value: int) -> np.ndarray:
    array = array.copy()
    array[index] = value
    return array


def _swap_offsets(offsets: np.ndarray) -> np.ndarray:
    offsets = offsets.copy()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    return offsets


def _masked_with_fresh_digest(entry: Path) -> None:
    """Every label masked, and the digest recomputed to match: the values themselves must be judged."""
    _edit_array(entry, "label_mask", np.zeros_like)
    meta = json.loads((entry / "meta.json").read_text())
    claimed = {k: v for k, v in meta.items() if k != "digest"}
    meta["digest"] = cache_module._content_digest(entry, claimed)
    (entry / "meta.json").write_text(json.dumps(meta))


def _without_digest(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    del meta["digest"]
    (entry / "meta.json").write_text(json.dumps(meta))


TAMPERINGS: dict[str, tuple[Callable[[Path], None], str]] = {
    "labels all masked, digest stale": (
        lambda e: _edit_array(e, "label_mask", np.zeros_like),
        "label_mask.npy leaves an example without a learned token",
    ),
    "labels all masked, digest fixed up": (
        _masked_with_fresh_digest,
        "label_mask.npy leaves an example without a learned token",
    ),
    "a prompt token unmasked, digest stale": (
        lambda e: _edit_array(e, "label_mask", lambda m: _set(m, int(np.flatnonzero(m == 0)[1]), 1)),
        "does not match the content digest in meta.json",
    ),
    "out-of-vocabulary id": (
        lambda e: _edit_array(e, "input_ids", lambda a: _set(a, 3, 10**6)),
        "input_ids.npy holds id 1000000 at token 3, outside the tokenizer's ids [0, ",
    ),
    "negative id": (
        lambda e: _edit_array(e, "input_ids", lambda a: _set(a, 5, -7)),
        "input_ids.npy holds id -7 at token 5",
    ),
    "offsets out of order": (
        lambda e: _edit_array(e, "offsets", _swap_offsets),
        "offsets.npy is not non-decreasing from 0 to the token count",
    ),
    "records array short": (
        lambda e: _edit_array(e, "records", lambda r: r[:-1]),
        "records.npy holds 5 values where 6 examples",
    ),
    "written before digests": (_without_digest, "has no content digest in meta.json"),
    "a planted pickle": (
        lambda e: np.save(e / "records.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True),
        "could not be read (records.npy: ValueError: ",
    ),
}


@pytest.mark.parametrize("tampering", list(TAMPERINGS))
def test_a_cache_entry_that_fails_a_check_is_tokenized_again_and_replaced(
    tmp_path: Path,
    tok: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tampering: str,
) -> None:
    """An entry is checked against what it claims: a bad one never reaches training; the data is
    tokenized again (equal to a fresh tokenization), the note names the entry and the failed check, and the
    replacement serves the next run."""
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    chats = _jsonl(tmp_path / "c.jsonl", CHATS)
    first = load_examples(chats, tok, 64, cache=True)
    assert load_examples(chats, tok, 64, cache=True).stats.from_cache  # a sound entry passes every check
    (entry,) = (tmp_path / "cache" / "tokenized").iterdir()
    tamper, check = TAMPERINGS[tampering]
    tamper(entry)
    capsys.readouterr()
    rebuilt = load_examples(chats, tok, 64, cache=True)
    assert not rebuilt.stats.from_cache
    assert (rebuilt.examples, rebuilt.records) == (first.examples, first.records)
    err = capsys.readouterr().err
    assert f"tokenization cache entry {entry} " in err and check in err, err
    assert err.count("\n") == 1  # one line
    again = load_examples(chats, tok, 64, cache=True)
    assert again.stats.from_cache and again.examples == first.examples
    assert capsys.readouterr().err == ""


def test_a_tampered_preference_entry_is_tokenized_again(
    tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Preference pairs go through the same checks: an out-of-vocabulary id is caught, not an IndexError."""
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    records = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(4)]
    path = _jsonl(tmp_path / "p.jsonl", records)
    first = load_preference_pairs(path, tok, 64, cache=True)
    (entry,) = (tmp_path / "cache" / "tokenized").iterdir()
    _edit_array(entry, "input_ids", lambda a: _set(a, 2, len(tok)))
    rebuilt = load_preference_pairs(path, tok, 64, cache=True)
    assert not rebuilt.stats.from_cache and rebuilt.examples == first.examples
    assert (
        f"holds id {len(tok)} at token 2, outside the tokenizer's ids [0, {len(tok)})"
        in capsys.readouterr().err
    )
    assert load_preference_pairs(path, tok, 64, cache=True).stats.from_cache


# ---------------------------------------------------------------- held-out evaluation split


def test_hold_out_is_seeded_disjoint_and_keeps_documents_whole(tmp_path: Path, tok: Any) -> None:
    docs = [{"text": "x" * (5 + 40 * (i % 2))} for i in range(20)]  # every other one splits into chunks
    data = load_examples(_jsonl(tmp_path / "t.jsonl", docs), tok, 16)
    train, held = hold_out(data, 0.2, seed=3)
    assert len(set(held.records)) == 4 and not set(held.records) & set(train.records)
    assert sorted(train.records + held.records) == sorted(data.records)  # every chunk, on one side
    assert hold_out(data, 0.2, seed=3)[1].records == held.records
    assert hold_out(data, 0.2, seed=4)[1].records != held.records
    assert (held.stats.n_lines, held.stats.n_examples) == (4, len(held.examples))
    assert train.stats.n_examples == len(train.examples) == len(data.examples) - len(held.examples)
    with pytest.raises(DataError, match=r"data\.eval_split = 0\.99 of 20 records leaves none to train on"):
        hold_out(data, 0.99, seed=3)


# ---------------------------------------------------------------- config checks of the data keys


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(
            load_config(
                None,
                [
                    f"data.path={DEMO_DATA}",
                    "batch.global_batch_size=4",
                    "batch.micro_batch_size=4",
                    *overrides,
                ],
            ),
            1,
        )
    return str(err.value)


def test_data_paths_are_files_folders_or_hub_ids(tmp_path: Path) -> None:
    base = ["batch.global_batch_size=4", "batch.micro_batch_size=4"]
    for path in ("org/some-dataset", "squad", str(tmp_path)):
        resolve(load_config(None, [f"data.path={path}", *base]), 1)  # checked when the data loads
    msg = _problems("data.path=data/missing.jsonl")
    assert "data.path = 'data/missing.jsonl': file does not exist" in msg
    assert "data.eval_path = './nope'" in _problems("data.eval_path=./nope")


def test_evaluation_keys_are_checked_together() -> None:
    assert "must be in (0, 1)" in _problems("data.eval_split=1.5")
    assert "use one of them" in _problems("data.eval_split=0.1", f"data.eval_path={DEMO_DATA}")
    assert "is a file, which has no splits" in _problems("data.eval_split=test")
    msg = _problems("eval.every_steps=10")
    assert "no evaluation data" in msg and "data.eval_split=0.02" in msg
    assert "neither a file nor a Jinja template" in _problems("data.chat_template=missing.jinja")
    cfg = load_config(
        None,
        [
            f"data.path={DEMO_DATA}",
            "batch.global_batch_size=4",
            "batch.micro_batch_size=4",
            "data.eval_split=0.02",
        ],
    )
    assert resolve(cfg, 1).config.data.eval_split == 0.02
