"""Prompt data of a GRPO run (`zerofit.data.prompts`): TRL's string and conversational layouts, every other
column kept for the rewards, prompts cut to their end, and the refusals as one paragraph."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zerofit.core.errors import DataError
from zerofit.data.prompts import columns_for, load_prompts
from zerofit.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_string_prompts_keep_every_other_column(tmp_path: Path, tok: Any) -> None:
    path = _jsonl(
        tmp_path / "p.jsonl", [{"prompt": "1+2=", "answer": "3", "id": 7}, {"prompt": "2+2=", "answer": 4}]
    )
    data = load_prompts(path, tok, 64)
    assert data.stats.format == "prompt" and data.stats.n_examples == 2 and data.stats.n_truncated == 0
    first = data.prompts[0]
    assert first.input_ids == [tok.bos_token_id, *tok.encode("1+2=", add_special_tokens=False)]
    assert first.text == "1+2=" and first.columns == {"answer": "3", "id": 7} and first.record == 0
    assert data.column_names == ["answer", "id"]
    assert columns_for(data.prompts, data.column_names, 2) == {
        "answer": ["3", "3", 4, 4],
        "id": [7, 7, None, None],
    }


def test_conversational_prompts_render_with_the_generation_prompt(tmp_path: Path, tok: Any) -> None:
    messages = [{"role": "user", "content": "1+2="}]
    data = load_prompts(_jsonl(tmp_path / "c.jsonl", [{"prompt": messages, "answer": "3"}]), tok, 64)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert data.stats.format == "conversational prompt"
    assert data.prompts[0].text == rendered
    assert (
        data.prompts[0].input_ids
        == tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    )


def test_a_long_prompt_keeps_its_end_and_bos(tmp_path: Path, tok: Any) -> None:
    path = _jsonl(tmp_path / "long.jsonl", [{"prompt": "abcdefghij" * 3 + "Q?"}, {"prompt": "ok"}])
    data = load_prompts(path, tok, 8)
    ids = data.prompts[0].input_ids
    assert len(ids) == 8 and ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "fghijQ?"
    assert data.stats.n_truncated == 1
    with pytest.raises(DataError, match=r"1 of 2 prompts \(50%\) are longer than rl.max_prompt_length = 8"):
        load_prompts(path, tok, 8, truncation="error")


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            {"question": "1+2=", "answer": "3"},
            r"bad.jsonl:1: no 'prompt' key \(keys present: 'question', 'answer'\)",
        ),
        ({"prompt": "  \n"}, r"bad.jsonl:1: the prompt is empty"),
        ({"prompt": []}, r"bad.jsonl:1: the prompt is empty"),
        ({"prompt": 5}, r"bad.jsonl:1: 'prompt' must be a list of messages"),
    ],
)
def test_refusals_are_one_paragraph(tmp_path: Path, tok: Any, record: dict[str, Any], expected: str) -> None:
    with pytest.raises(DataError, match=expected) as caught:
        load_prompts(_jsonl(tmp_path / "bad.jsonl", [record]), tok, 64)
    assert "\n" not in str(caught.value)
