"""KTO's unpaired data (`zerofit.data.unpaired`): TRL's {prompt, completion, label} records, strings or
conversational, the cache, and one paragraph for each bad record or config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zerofit.core.errors import DataError
from zerofit.data import IGNORE_INDEX
from zerofit.data.unpaired import load_unpaired, require_both_labels
from zerofit.models.tiny import ensure_tiny_llama

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_llama(0))


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_string_records_are_prompt_then_completion_with_labels_on_the_completion(
    tok: Any, tmp_path: Path
) -> None:
    records = [
        {"prompt": "add: 2+3\n", "completion": "5", "label": True},
        {"prompt": "hi\n", "completion": "#", "label": False},
    ]
    data = load_unpaired(_jsonl(tmp_path / "d.jsonl", records), tok, 64)
    first = data.examples[0]
    prompt = [tok.bos_token_id, *tok("add: 2+3\n", add_special_tokens=False)["input_ids"]]
    assert first.input_ids[: first.prompt_len] == prompt
    assert first.input_ids[-1] == tok.eos_token_id
    assert first.labels == [IGNORE_INDEX] * len(prompt) + first.input_ids[len(prompt) :]
    assert [u.desirable for u in data.examples] == [True, False]
    assert data.stats.format == "unpaired" and data.records == [0, 1]


def test_conversational_records_learn_the_assistant_answer_only(tok: Any, tmp_path: Path) -> None:
    records = [
        {
            "prompt": [{"role": "user", "content": "reverse: abc"}],
            "completion": [{"role": "assistant", "content": "cba"}],
            "label": True,
        }
    ]
    (unit,) = load_unpaired(_jsonl(tmp_path / "c.jsonl", records), tok, 64).examples
    learned = [t for t in unit.labels if t != IGNORE_INDEX]
    assert "cba" in tok.decode(learned) and "reverse" not in tok.decode(learned)
    assert all(t == IGNORE_INDEX for t in unit.labels[: unit.prompt_len])


def test_the_cache_gives_back_the_same_examples(
    tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    path = REPO / "data" / "demo_kto.jsonl"
    first = load_unpaired(path, tok, 64, cache=True)
    again = load_unpaired(path, tok, 64, cache=True)
    assert not first.stats.from_cache and again.stats.from_cache
    assert again.examples == first.examples and again.records == first.records
    assert 0 < sum(u.desirable for u in first.examples) < len(first.examples)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"prompt": "p", "completion": "c"},
            r":1: missing 'label'\. KTO learns from TRL's unpaired layout",
        ),
        (
            {"prompt": "p", "chosen": "a", "rejected": "b"},
            r"missing 'completion', 'label' \(it looks like a preference pair",
        ),
        ({"prompt": "p", "completion": "c", "label": "yes"}, r"'label' is 'yes' \(str\).*JSON boolean"),
        ({"prompt": "p", "completion": "c", "label": 1}, r"'label' is 1 \(int\)"),
        (
            {"prompt": "p", "completion": [{"role": "assistant", "content": "c"}], "label": True},
            r"both must be strings",
        ),
    ],
)
def test_a_bad_record_is_one_paragraph(
    tok: Any, tmp_path: Path, record: dict[str, Any], message: str
) -> None:
    with pytest.raises(DataError, match=message):
        load_unpaired(_jsonl(tmp_path / "bad.jsonl", [record]), tok, 64)


def test_training_data_of_one_label_is_refused(tok: Any, tmp_path: Path) -> None:
    records = [{"prompt": f"q{i}\n", "completion": "a", "label": True} for i in range(3)]
    data = load_unpaired(_jsonl(tmp_path / "one.jsonl", records), tok, 64)
    with pytest.raises(DataError, match=r"data\.path: all 3 examples have label true .*train\.objective=sft"):
        require_both_labels(data, "data.path")
    assert require_both_labels(data, "data.eval_path", check=False) is data  # held-out data may be one-sided


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.enabled=false"], r"train\.objective = 'kto' compares the policy .*lora\.enabled=true"),
        (["data.format=preference"], r"data\.format = 'preference' names another format"),
    ],
)
def test_resolve_refuses_kto_configs_it_cannot_run(overrides: list[str], message: str) -> None:
    from zerofit.config.loader import load_config
    from zerofit.core.errors import ConfigError
    from zerofit.resolution import resolve

    base = [f"data.path={REPO / 'data' / 'demo_kto.jsonl'}", "train.objective=kto", "lora.enabled=true"]
    base += ["distributed.strategy=single", "batch.global_batch_size=4", "batch.micro_batch_size=2"]
    with pytest.raises(ConfigError, match=message) as err:
        resolve(load_config(None, base + overrides), 1)
    assert len(err.value.problems) == 1
    resolve(load_config(None, base), 1)  # the config itself is fine
    with pytest.raises(ConfigError, match=r"data\.format = 'unpaired' is KTO's"):
        resolve(load_config(None, [*base[:1], "data.format=unpaired", *base[3:]]), 1)


def test_unpaired_data_read_for_sft_names_kto(tok: Any) -> None:
    from zerofit.data import load_examples

    with pytest.raises(DataError, match=r"KTO's unpaired feedback: set train\.objective=kto"):
        load_examples(REPO / "data" / "demo_kto.jsonl", tok, 64)
