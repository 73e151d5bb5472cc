"""Data pipeline: prompt masking, truncation accounting, clear errors, padding, and a split-independent order."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from zerofit.core.errors import DataError, ZerofitError
from zerofit.data import (
    IGNORE_INDEX,
    Example,
    GlobalBatchSampler,
    collate,
    load_examples,
    load_sft_dataset,
    split_global_batch,
)
from zerofit.models.tiny import ensure_tiny_llama

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_llama(0))


def _write(tmp_path: Path, lines: list[str], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _pair(prompt: str, response: str) -> str:
    return json.dumps({"prompt": prompt, "response": response})


# ---------------------------------------------------------------- loading


def test_prompt_and_bos_are_masked_response_and_eos_are_labels(tmp_path: Path, tok: Any) -> None:
    path = _write(tmp_path, [_pair("ab", "cd"), "", _pair("", "x")])
    examples, stats = load_sft_dataset(path, tok, 64)
    a, b, c, d, x = (tok.convert_tokens_to_ids(ch) for ch in "abcdx")
    assert examples[0] == Example([1, a, b, c, d, 2], [IGNORE_INDEX] * 3 + [c, d, 2])
    assert examples[1] == Example([1, x, 2], [IGNORE_INDEX, x, 2])  # empty prompt: only bos is masked
    assert stats.n_lines == 3 and stats.n_examples == 2 and stats.n_truncated == stats.n_dropped == 0


def test_a_response_ending_in_eos_gets_no_second_one(tmp_path: Path, tok: Any) -> None:
    """TRL's rule: eos is appended unless the response already ends in it (`[..., 2]`, never `[..., 2, 2]`)."""
    path = _write(tmp_path, [_pair("ab", "cd</s>"), _pair("ab", "cd"), _pair("ab", "cd</s> ")])
    examples, _ = load_sft_dataset(path, tok, 64)
    a, b, c, d = (tok.convert_tokens_to_ids(ch) for ch in "abcd")
    assert examples[0] == examples[1] == Example([1, a, b, c, d, 2], [IGNORE_INDEX] * 3 + [c, d, 2])
    # eos inside the text, not at its end: the text is learned as written, and one eos ends it
    ids = examples[2].input_ids
    assert ids == [1, a, b, *tok.encode("cd</s> ", add_special_tokens=False), 2] and ids[-3] == ids[-1] == 2


def test_truncation_is_counted_and_fully_truncated_responses_dropped(tmp_path: Path, tok: Any) -> None:
    lines = [
        _pair("p", "rrrr"),  # 1 + 1 + 4 + 1 = 7 tokens: kept whole
        _pair("pp", "rrrrrrr"),  # 11 tokens: truncated to 8, keeps 5 response tokens, loses eos
        _pair("pppppppp", "r"),  # bos + 8 prompt tokens >= 8: no response left -> dropped
    ]
    examples, stats = load_sft_dataset(_write(tmp_path, lines), tok, 8)
    assert (stats.n_lines, stats.n_examples, stats.n_truncated, stats.n_dropped) == (3, 2, 1, 1)
    assert [len(e.input_ids) for e in examples] == [7, 8]
    assert examples[1].labels[:3] == [IGNORE_INDEX] * 3 and IGNORE_INDEX not in examples[1].labels[3:]
    assert tok.eos_token_id not in examples[1].input_ids


def test_many_cut_examples_are_said_with_the_length_that_keeps_95_percent_whole(
    tmp_path: Path, tok: Any
) -> None:
    """A third of a CSV cut to 64 tokens was once only a count in the plan. Above 5% cut, the plan warns
    once with the data.max_seq_len that keeps 95% whole; data.truncation=error refuses instead."""
    from zerofit.config import load_config
    from zerofit.data.truncation import check_truncation
    from zerofit.recipe.run_report import truncation_warning

    # The tiny tokenizer spells one character per token: an example is bos + prompt + response + eos.
    lines = [_pair("p", "r" * n) for n in range(1, 13)] + [_pair("pp", "r" * (20 + n)) for n in range(8)]
    lengths = sorted([3 + n for n in range(1, 13)] + [4 + 20 + n for n in range(8)])
    data_file = _write(tmp_path, lines)
    _, stats = load_sft_dataset(data_file, tok, 16)
    assert (stats.n_examples, stats.n_truncated) == (20, 8)
    assert stats.whole_len == lengths[18] == 30  # 19 of the 20 examples (95%) fit in 30 tokens
    cfg = load_config(None, [f"data.path={data_file}", "data.max_seq_len=16"])
    (line,) = truncation_warning(cfg, stats)
    assert "8 of 20 examples (40%) are cut to data.max_seq_len = 16 tokens" in line
    assert "data.max_seq_len=30 keeps 95% of them whole" in line and "data.truncation=error refuses" in line
    allowed = load_config(None, [f"data.path={data_file}", "data.max_seq_len=16", "data.truncation=allow"])
    assert truncation_warning(allowed, stats) == []
    data = load_examples(data_file, tok, 16)
    assert check_truncation(data, 16, "warn") is data and check_truncation(data, 16, "allow") is data
    with pytest.raises(DataError) as err:
        check_truncation(data, 16, "error")
    assert "data.truncation = 'error' refuses such data" in str(err.value) and "data.max_seq_len=30" in str(
        err.value
    )
    # At most 5% cut (1 of 20) is the count in the data line only; a conversation's length is measured too.
    few = _write(tmp_path, [_pair("p", "r")] * 19 + lines[-1:], "few.jsonl")
    _, few_stats = load_sft_dataset(few, tok, 16)
    assert few_stats.n_truncated == 1 and truncation_warning(cfg, few_stats) == []
    check_truncation(load_examples(few, tok, 16), 16, "error")  # passes: within the 5%
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y" * 40}]
    chat.write_text(json.dumps({"messages": turns}) + "\n")
    _, chat_stats = load_sft_dataset(chat, tok, 16)
    _, whole_stats = load_sft_dataset(chat, tok, 128)
    assert chat_stats.n_truncated == 1 and chat_stats.whole_len == whole_stats.whole_len > 40


def test_every_example_dropped_names_max_seq_len_and_longest_prompt(tmp_path: Path, tok: Any) -> None:
    path = _write(tmp_path, [_pair("pppppppppp", "r"), _pair("ppppp", "r")])
    with pytest.raises(DataError) as err:
        load_sft_dataset(path, tok, 4)
    msg = str(err.value)
    assert str(path) in msg and "data.max_seq_len = 4" in msg
    assert "longest prompt is 11 tokens" in msg and "at least 13" in msg


@pytest.mark.parametrize(
    ("lines", "lineno", "needle"),
    [
        ([_pair("a", "b"), "{not json"], 2, "invalid JSON"),
        ([_pair("a", "b"), "", '["a", "b"]'], 3, "expected a JSON object"),
        (['{"prompt": "a"}'], 1, "missing key 'response'"),
        (['{"response": "a", "instruction": "x"}'], 1, "missing key 'prompt'"),
        ([_pair("a", "b"), '{"prompt": 3, "response": "b"}'], 2, "'prompt' must be a string"),
        (['{"prompt": "a", "response": null}'], 1, "'response' must be a string"),
    ],
)
def test_bad_lines_name_file_and_line(
    tmp_path: Path, tok: Any, lines: list[str], lineno: int, needle: str
) -> None:
    path = _write(tmp_path, lines)
    with pytest.raises(DataError) as err:
        load_sft_dataset(path, tok, 64)
    assert isinstance(err.value, ZerofitError)
    assert f"{path}:{lineno}:" in str(err.value) and needle in str(err.value)


def test_invalid_utf8_names_the_line(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(_pair("a", "b").encode() + b"\n" + b'{"prompt": "\xff", "response": "b"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid UTF-8"):
        load_sft_dataset(path, tok, 64)


def test_missing_and_empty_files(tmp_path: Path, tok: Any) -> None:
    with pytest.raises(DataError, match=r"data\.path = .*nope\.jsonl.*does not exist"):
        load_sft_dataset(tmp_path / "nope.jsonl", tok, 64)
    for content in ("", "\n  \n\n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(content)
        with pytest.raises(DataError, match=r"empty\.jsonl: no examples"):
            load_sft_dataset(path, tok, 64)


def test_demo_data_loads_whole_and_short(tok: Any) -> None:
    examples, stats = load_sft_dataset(REPO / "data" / "demo.jsonl", tok, 64)
    assert 2000 <= stats.n_examples == stats.n_lines <= 4000
    assert stats.n_truncated == stats.n_dropped == 0
    assert max(len(e.input_ids) for e in examples) <= 60
    assert (
        len({len(e.input_ids) for e in examples}) > 10
    )  # varied lengths: padding and token weighting matter


def test_empty_responses_are_dropped_counted_and_named_in_the_data_line(tmp_path: Path, tok: Any) -> None:
    from zerofit.recipe.run_report import describe_data

    lines = [
        _pair("a", "b"),
        _pair("c", ""),
        _pair("d", "e"),
        _pair("f", "  \n"),
        _pair("g", "h"),
        _pair("i", "j"),
    ]
    path = _write(tmp_path, lines)
    examples, stats = load_sft_dataset(path, tok, 64)
    assert len(examples) == 4 and stats.n_dropped == 2 and stats.n_empty == 2
    assert "2 dropped: 2 for an empty response" in describe_data(str(path), stats, 64)
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (turns, good, good)))
    examples, stats = load_sft_dataset(chat, tok, 64)
    assert len(examples) == 2 and stats.n_empty == 1 and stats.n_dropped == 1


def test_a_source_with_mostly_empty_responses_is_refused(tmp_path: Path, tok: Any) -> None:
    for lines in ([_pair("a", ""), _pair("b", ""), _pair("c", "d")], [_pair("a", ""), _pair("b", "")]):
        path = _write(tmp_path, lines)
        with pytest.raises(DataError) as err:
            load_sft_dataset(path, tok, 64)
        text = str(err.value)
        assert text.startswith(
            f"{path}: {len(lines) - (len(lines) == 3)} of {len(lines)} records have an empty"
        )
        assert "'response'" in text and "data.empty_responses=keep" in text


def test_empty_responses_can_be_kept_or_refused(tmp_path: Path, tok: Any) -> None:
    from zerofit.recipe.run_report import describe_data

    path = _write(tmp_path, [_pair("a", "b"), _pair("c", ""), _pair("d", "e")])
    examples, stats = load_sft_dataset(path, tok, 64, empty_responses="keep")
    assert len(examples) == 3 and stats.n_empty == 1 and stats.n_dropped == 0
    assert "1 with an empty response kept" in describe_data(str(path), stats, 64)
    with pytest.raises(DataError, match=r"d\.jsonl:2: the response is empty .*data\.empty_responses=drop"):
        load_sft_dataset(path, tok, 64, empty_responses="error")


def test_the_empty_response_rule_is_part_of_the_tokenization_cache_key(tmp_path: Path, tok: Any) -> None:
    path = _write(tmp_path, [_pair("a", "b"), _pair("c", ""), _pair("d", "e")])
    dropped, _ = load_sft_dataset(path, tok, 64, cache=True)
    kept, _ = load_sft_dataset(path, tok, 64, cache=True, empty_responses="keep")
    again, stats = load_sft_dataset(path, tok, 64, cache=True)
    assert (len(dropped), len(kept), len(again), stats.from_cache) == (2, 3, 2, True)


# ---------------------------------------------------------------- collate


def test_collate_right_pads_and_masks_padding() -> None:
    batch = collate([Example([1, 5, 6, 2], [-100, -100, 6, 2]), Example([1, 7], [-100, 7])], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 2], [1, 7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 6, 2], [-100, 7, -100, -100]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collate_empty_gives_one_dummy_row_without_labels() -> None:
    batch = collate([], pad_id=0)
    assert batch["input_ids"].tolist() == [[0]]
    assert batch["attention_mask"].tolist() == [[1]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX]]


# ---------------------------------------------------------------- sampler and split

SPLITS = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]  # (micro, GAS, dp) of a global batch of 8


def _all_micro_batches(indices: list[int], mbs: int, gas: int, dp: int) -> list[list[int]]:
    parts = [split_global_batch(indices, mbs, gas, dp, r) for r in range(dp)]
    assert all(len(p) == gas for p in parts)  # every rank runs every micro-step
    return [mb for p in parts for mb in p]


def test_every_split_covers_the_same_global_batch() -> None:
    sampler = GlobalBatchSampler(num_examples=37, global_batch_size=8, seed=3)
    for step in range(10):
        indices = sampler.batch_indices(step)
        assert len(indices) == 8
        for mbs, gas, dp in SPLITS:
            micro = _all_micro_batches(indices, mbs, gas, dp)
            assert all(len(mb) == mbs for mb in micro)
            assert Counter(i for mb in micro for i in mb) == Counter(indices)


def test_split_layout_is_micro_step_major() -> None:
    idx = list(range(100, 108))
    assert split_global_batch(idx, 2, 2, 2, 0) == [[100, 101], [104, 105]]
    assert split_global_batch(idx, 2, 2, 2, 1) == [[102, 103], [106, 107]]
    # A short (partial) window: tail entries shrink or empty, but each rank still has GAS entries.
    assert split_global_batch(idx[:5], 2, 2, 2, 0) == [[100, 101], [104]]
    assert split_global_batch(idx[:5], 2, 2, 2, 1) == [[102, 103], []]
    with pytest.raises(ValueError):
        split_global_batch(list(range(9)), 2, 2, 2, 0)


def test_drop_skips_the_remainder_and_it_never_leaks() -> None:
    sampler = GlobalBatchSampler(20, 8, seed=1, partial_window="drop")
    assert sampler.steps_per_epoch == 2
    for epoch in range(3):
        steps = range(epoch * 2, epoch * 2 + 2)
        batches = [sampler.batch_indices(s) for s in steps]
        assert all(len(b) == 8 and not sampler.is_partial(s) for s, b in zip(steps, batches, strict=True))
        seen = [i for b in batches for i in b]
        assert len(set(seen)) == 16  # no index twice within an epoch
        assert {sampler.epoch_of(s) for s in steps} == {epoch}
    # Each epoch is a fresh permutation: the 4 left out differ between epochs (so all data gets used).
    left_out = [
        set(range(20)) - {i for s in (2 * e, 2 * e + 1) for i in sampler.batch_indices(s)} for e in range(3)
    ]
    assert len({frozenset(x) for x in left_out}) > 1


def test_normalize_yields_the_remainder_as_one_short_batch_per_epoch() -> None:
    sampler = GlobalBatchSampler(20, 8, seed=1, partial_window="normalize")
    assert sampler.steps_per_epoch == 3
    for epoch in range(2):
        steps = [3 * epoch + k for k in range(3)]
        sizes = [len(sampler.batch_indices(s)) for s in steps]
        assert sizes == [8, 8, 4]
        assert [sampler.is_partial(s) for s in steps] == [False, False, True]
        epoch_indices = sorted(i for s in steps for i in sampler.batch_indices(s))
        assert epoch_indices == list(range(20))  # every example exactly once, nothing carried over


def test_order_is_deterministic_pure_and_seeded() -> None:
    a = GlobalBatchSampler(50, 8, seed=5)
    b = GlobalBatchSampler(50, 8, seed=5)
    backwards = [b.batch_indices(s) for s in reversed(range(20))][::-1]  # resume-style random access
    assert [a.batch_indices(s) for s in range(20)] == backwards
    assert a.batch_indices(0) != GlobalBatchSampler(50, 8, seed=6).batch_indices(0)
    assert a.batch_indices(0) != a.batch_indices(a.steps_per_epoch)  # a new permutation each epoch
    assert GlobalBatchSampler(20, 8, seed=5, shuffle=False).batch_indices(1) == list(range(8, 16))


def test_fewer_examples_than_global_batch(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"3 examples, fewer than batch\.global_batch_size = 8"):
        GlobalBatchSampler(3, 8, seed=0)
    sampler = GlobalBatchSampler(3, 8, seed=0, partial_window="normalize")
    assert sampler.steps_per_epoch == 1 and sampler.is_partial(4)
    assert sorted(sampler.batch_indices(4)) == [0, 1, 2]
