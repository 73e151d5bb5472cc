"""Preference data: TRL's `{prompt, chosen, rejected}` layout (strings and conversational, the implicit prompt)
detected by `data.format: auto` from every kind of source, tokenized into pairs that share their prompt tokens
with labels on the responses only, truncated by the stated rule, identical / empty pairs dropped with counts,
through the tokenization cache and held-out splits, and loaded as pairs by the assembly."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from zerofit.core.errors import DataError
from zerofit.data import IGNORE_INDEX, hold_out, load_examples, load_preference_pairs
from zerofit.data.formats import Preference, detect_format, parse_record
from zerofit.data.pairs import PreferencePair
from zerofit.data.preference import ResponseTokens, fit_pair, tokenize_pair
from zerofit.models.tiny import ensure_tiny_llama

REPO = Path(__file__).resolve().parents[3]
STRINGS = {"prompt": "copy: abc\n", "chosen": "abc", "rejected": "#$%"}
CONVERSATIONAL = {
    "prompt": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},  # a turn inside the prompt: never learned
        {"role": "user", "content": "copy: abc"},
    ],
    "chosen": [{"role": "assistant", "content": "abc"}],
    "rejected": [{"role": "assistant", "content": "#$%"}],
}


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_llama(0))


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _learned(example: Any) -> list[int]:
    return [t for t in example.labels if t != IGNORE_INDEX]


def _shared_prompt(pair: PreferencePair) -> list[int]:
    """The prompt tokens: the unlabelled start, which must be the same for both sequences."""
    n = next(i for i, t in enumerate(pair.chosen.labels) if t != IGNORE_INDEX)
    assert pair.rejected.labels[:n] == [IGNORE_INDEX] * n
    assert pair.chosen.input_ids[:n] == pair.rejected.input_ids[:n]
    return pair.chosen.input_ids[:n]


def test_auto_detects_both_layouts_and_the_implicit_prompt() -> None:
    implicit = {
        "chosen": [*CONVERSATIONAL["prompt"], *CONVERSATIONAL["chosen"]],
        "rejected": [*CONVERSATIONAL["prompt"], *CONVERSATIONAL["rejected"]],
    }
    for record in (STRINGS, CONVERSATIONAL, implicit):
        assert detect_format(record, "x") == "preference"
    assert detect_format({"prompt": "p", "response": "r"}, "x") == "prompt_response"
    parsed = parse_record("preference", implicit, "x")
    assert isinstance(parsed, Preference)
    assert parsed == parse_record("preference", CONVERSATIONAL, "x")  # the shared turns are the prompt
    texts = {"chosen": "Q: copy ab A: ab", "rejected": "Q: copy ab A: #$"}
    assert detect_format(texts, "x") == "preference"
    assert parse_record("preference", texts, "x") == Preference("Q: copy ab A:", " ab", " #$")  # TRL's rule
    with pytest.raises(
        DataError, match=r"x: 'chosen' and 'rejected' have no 'prompt' and share no beginning"
    ):
        parse_record("preference", {"chosen": "ab", "rejected": "cd"}, "x")
    with pytest.raises(
        DataError, match=r"x: 'chosen' / 'rejected' are lists of messages but 'prompt' is a str"
    ):
        parse_record("preference", {**CONVERSATIONAL, "prompt": "hi"}, "x")
    with pytest.raises(DataError, match=r"'chosen' holds messages of roles 'assistant', 'user'"):
        parse_record("preference", {**CONVERSATIONAL, "chosen": CONVERSATIONAL["prompt"][1:]}, "x")


def test_strings_are_bos_prompt_then_response_and_eos_with_labels_on_the_response(tok: Any) -> None:
    pair, prompt_cut, truncated = tokenize_pair(tok, parse_record("preference", STRINGS, "x"), 64)
    assert not prompt_cut and not truncated
    prompt = [tok.bos_token_id, *tok.encode("copy: abc\n", add_special_tokens=False)]
    assert _shared_prompt(pair) == prompt
    for example, text in ((pair.chosen, "abc"), (pair.rejected, "#$%")):
        response = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        assert example.input_ids == prompt + response
        assert _learned(example) == response


def test_a_response_ending_in_eos_gets_no_second_one(tok: Any) -> None:
    """TRL's DPO rule, for each response: eos is appended unless the response already ends in it."""
    written = {**STRINGS, "chosen": "abc</s>", "rejected": "#$%"}
    pair, _, _ = tokenize_pair(tok, parse_record("preference", written, "x"), 64)
    plain, _, _ = tokenize_pair(tok, parse_record("preference", STRINGS, "x"), 64)
    assert pair == plain
    assert pair.chosen.input_ids[-2:] == [tok.convert_tokens_to_ids("c"), tok.eos_token_id]


def test_conversational_pairs_learn_only_the_response_through_the_chat_template(tok: Any) -> None:
    pair, _, _ = tokenize_pair(tok, parse_record("preference", CONVERSATIONAL, "x"), 64)
    prompt = tok.apply_chat_template(CONVERSATIONAL["prompt"], add_generation_prompt=True, tokenize=False)
    assert tok.decode(_shared_prompt(pair)) == prompt  # the earlier assistant turn "yo" is not learned
    for example, text in ((pair.chosen, "abc"), (pair.rejected, "#$%")):
        assert tok.decode(_learned(example)) == text + tok.eos_token
        assert tok.decode(example.input_ids) == prompt + text + tok.eos_token


def test_truncation_cuts_the_prompt_from_its_start_keeping_bos_then_the_responses_at_their_end() -> None:
    bos, prompt = [1], [1, *range(10, 30)]  # bos + 20 prompt tokens

    def response(n: int) -> ResponseTokens:
        return ResponseTokens(list(range(100, 100 + n)), [True] * n)

    # Fits: nothing is cut.
    p, c, r, prompt_cut, cut = fit_pair(prompt, 1, response(5), response(3), 32)
    assert (p, c.ids, r.ids, prompt_cut, cut) == (prompt, response(5).ids, response(3).ids, False, False)
    # The prompt gives way first: bos, then its last tokens, so the longer response fits whole.
    p, c, r, prompt_cut, cut = fit_pair(prompt, 1, response(12), response(3), 24)
    assert p == bos + prompt[-11:] and c.ids == response(12).ids and r.ids == response(3).ids
    assert prompt_cut and cut
    # ... but never below half the sequence: then the responses are cut at their end.
    p, c, r, prompt_cut, cut = fit_pair(prompt, 1, response(30), response(3), 24)
    assert p == bos + prompt[-11:] and c.ids == response(12).ids and r.ids == response(3).ids
    # A short prompt is kept whole and the long response alone is cut.
    p, c, _, prompt_cut, cut = fit_pair(prompt[:4], 1, response(30), response(3), 24)
    assert p == prompt[:4] and c.ids == response(20).ids and not prompt_cut and cut


def test_a_long_string_prompt_keeps_its_end_next_to_the_response(tok: Any, tmp_path: Path) -> None:
    record = {"prompt": "x" * 5000 + "copy: abc\n", "chosen": "abc", "rejected": "#$%"}
    data = load_preference_pairs(_jsonl(tmp_path / "long.jsonl", [record]), tok, 32)
    pair = data.examples[0]
    assert len(pair.chosen.input_ids) <= 32
    assert tok.decode(_shared_prompt(pair)).endswith("copy: abc\n")
    assert pair.chosen.input_ids[0] == tok.bos_token_id
    assert (data.stats.n_truncated, data.stats.n_prompt_cut) == (1, 1)


def test_identical_and_empty_pairs_are_dropped_and_counted(tok: Any, tmp_path: Path) -> None:
    records = [STRINGS] * 6 + [
        {**STRINGS, "rejected": "abc"},  # identical
        {**STRINGS, "rejected": " "},  # empty
        {**STRINGS, "chosen": "abc" * 40, "rejected": "abc" * 40 + "#"},  # identical once cut to 32 tokens
    ]
    data = load_preference_pairs(_jsonl(tmp_path / "d.jsonl", records), tok, 32)
    s = data.stats
    assert (s.n_examples, s.n_identical, s.n_empty, s.n_dropped) == (6, 2, 1, 3)
    assert data.records == list(range(6))
    from zerofit.recipe.run_report import describe_data

    assert describe_data("d.jsonl", s, 32) == (
        "d.jsonl [preference, detected]: 6 pairs (0 truncated to 32 tokens per sequence, 0 with the prompt cut "
        "from its start, 3 dropped: 2 with identical chosen and rejected, 1 for an empty response)"
    )
    kept = load_preference_pairs(tmp_path / "d.jsonl", tok, 32, empty_responses="keep")
    assert (kept.stats.n_examples, kept.stats.n_identical, kept.stats.n_dropped) == (7, 2, 2)
    with pytest.raises(DataError, match=r"d\.jsonl:7: 'chosen' and 'rejected' are the same tokens"):
        load_preference_pairs(tmp_path / "d.jsonl", tok, 32, empty_responses="error")


def test_a_source_of_mostly_identical_or_empty_pairs_is_refused(tok: Any, tmp_path: Path) -> None:
    same = _jsonl(
        tmp_path / "same.jsonl", [STRINGS, {**STRINGS, "rejected": "abc"}, {**STRINGS, "rejected": "abc"}]
    )
    with pytest.raises(
        DataError, match=r"2 of 3 pairs have the same chosen and rejected tokens \(the first at \S+:2\)"
    ):
        load_preference_pairs(same, tok, 32)
    empty = _jsonl(tmp_path / "empty.jsonl", [STRINGS, {**STRINGS, "chosen": ""}, {**STRINGS, "chosen": ""}])
    with pytest.raises(DataError, match=r"2 of 3 pairs have an empty response .*data.empty_responses=keep"):
        load_preference_pairs(empty, tok, 32)


def test_the_objective_and_the_data_format_must_agree(tok: Any, tmp_path: Path) -> None:
    pairs = _jsonl(tmp_path / "pairs.jsonl", [STRINGS])
    with pytest.raises(DataError, match=r"found 'preference'.*train.objective = 'sft'.*train.objective=dpo"):
        load_examples(pairs, tok, 32)
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(DataError, match=r"found 'prompt_response', and train.objective = 'orpo'.*'chosen'"):
        load_preference_pairs(sft, tok, 32, objective="orpo")


def _write_source(kind: str, folder: Path, records: list[dict[str, Any]]) -> Path:
    if kind == "jsonl":
        return _jsonl(folder / "d.jsonl", records)
    if kind == "json":
        (folder / "d.json").write_text(json.dumps(records))
        return folder / "d.json"
    if kind == "csv":
        with (folder / "d.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
        return folder / "d.csv"
    import datasets

    dataset = datasets.Dataset.from_list(records)
    if kind == "parquet":
        dataset.to_parquet(str(folder / "d.parquet"))
        return folder / "d.parquet"
    dataset.save_to_disk(str(folder / "saved"))
    return folder / "saved"


@pytest.mark.parametrize(
    ("kind", "record"),
    [
        ("jsonl", CONVERSATIONAL),
        ("json", STRINGS),
        ("csv", STRINGS),
        ("parquet", CONVERSATIONAL),
        ("save_to_disk", CONVERSATIONAL),
    ],
)
def test_every_source_kind_gives_the_same_pairs(
    tok: Any, tmp_path: Path, kind: str, record: dict[str, Any]
) -> None:
    records = [record, {**record, "rejected": record["chosen"]}, record]  # the middle one is identical
    expected = load_preference_pairs(_jsonl(tmp_path / "ref.jsonl", records), tok, 64)
    data = load_preference_pairs(_write_source(kind, tmp_path, records), tok, 64)
    assert data.stats.format == "preference" and data.stats.detected
    assert data.examples == expected.examples and data.records == [0, 2]


def test_the_cache_gives_back_the_same_pairs_and_never_an_sft_entry(
    tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    path = REPO / "data" / "demo_preference_chat.jsonl"
    first = load_preference_pairs(path, tok, 64, cache=True)
    again = load_preference_pairs(path, tok, 64, cache=True)
    assert not first.stats.from_cache and again.stats.from_cache
    assert again.examples == first.examples and again.records == first.records
    assert {**vars(again.stats), "from_cache": False} == vars(first.stats)
    # The same source read for SFT is another entry: it tokenizes (and refuses the pairs) rather than hit.
    with pytest.raises(DataError, match=r"train\.objective = 'sft'"):
        load_examples(path, tok, 64, cache=True)


def test_a_held_out_fraction_holds_out_whole_pairs(tok: Any) -> None:
    data = load_preference_pairs(REPO / "data" / "demo_preference.jsonl", tok, 64)
    train, held = hold_out(data, 0.1, seed=3)
    assert (len(train.examples), len(held.examples)) == (540, 60)
    assert not set(train.records) & set(held.records)
    assert all(isinstance(p, PreferencePair) for p in held.examples)
    by_record = dict(zip(data.records, data.examples, strict=True))
    assert all(by_record[r] == p for r, p in zip(held.records, held.examples, strict=True))
    assert held.stats.n_examples == 60 and held.stats.format == "preference"


def test_a_preference_run_assembles_its_training_and_eval_data_as_pairs(tmp_path: Path) -> None:
    from zerofit.config.loader import load_config
    from zerofit.recipe import assembly
    from zerofit.resolution import resolve

    overrides = [
        f"data.path={REPO / 'data' / 'demo_preference.jsonl'}",
        "train.objective=dpo",
        "data.eval_split=0.1",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
        "distributed.strategy=single",
        "train.max_steps=2",
        f"output_dir={tmp_path / 'runs'}",
    ]
    run = assembly.assemble(resolve(load_config(None, overrides), 1))
    try:
        assert run.data is not None and run.data.eval_examples is not None
        assert all(isinstance(p, PreferencePair) for p in run.data.examples + run.data.eval_examples)
        assert (len(run.data.examples), len(run.data.eval_examples)) == (540, 60)
        assert run.data.sampler.steps_per_epoch == 540 // 4  # the global batch counts pairs
        learned = [len(_learned(p.chosen)) + len(_learned(p.rejected)) for p in run.data.examples]
        assert run.data.mean_label_tokens == sum(learned) / 540  # per pair: both sequences count
    finally:
        run.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.format=preference"],
            r"data\.format = 'preference' .*train\.objective = 'sft'.*train\.objective=dpo",
        ),
        (
            ["train.objective=simpo", "data.format=prompt_response"],
            r"train\.objective = 'simpo' learns from preference pairs, and data\.format = 'prompt_response'.*"
            r"data\.format=preference",
        ),
        (["train.objective=dpo", "preference.reference=none"], r"DPO's loss .*preference\.reference=auto"),
        (
            ["train.objective=dpo", "preference.reference=adapters_off", "lora.enabled=false"],
            r"lora\.enabled = false leaves no adapters .*preference\.reference=precomputed",
        ),
        (["train.objective=simpo", "preference.reference=precomputed"], r"uses no reference model"),
    ],
)
def test_resolve_refuses_objectives_and_data_that_disagree(overrides: list[str], message: str) -> None:
    from zerofit.config.loader import load_config
    from zerofit.core.errors import ConfigError
    from zerofit.resolution import resolve

    base = [
        f"data.path={REPO / 'data' / 'demo_preference.jsonl'}",
        "distributed.strategy=single",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
    ]
    with pytest.raises(ConfigError, match=message) as err:
        resolve(load_config(None, base + overrides), 1)
    assert len(err.value.problems) == 1  # one paragraph, nothing else wrong
    resolve(load_config(None, [*base, "train.objective=orpo", "data.format=preference"]), 1)  # agreeing


def test_the_margin_column_rides_with_its_pair_through_the_cache(
    tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's reward-model `margin` column: kept per pair (none on a record without one), collated as 0 for
    those, and read back from the tokenization cache; a value that is not a finite number is refused."""
    from zerofit.data.pairs import collate_pairs

    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    records = [
        {"prompt": "a", "chosen": "good", "rejected": "bad", "margin": 1.5},
        {"prompt": "b", "chosen": "fine", "rejected": "worse"},
        {"prompt": "c", "chosen": "yes", "rejected": "no", "margin": 0},
    ]
    path = _jsonl(tmp_path / "m.jsonl", records)
    for _ in range(2):  # tokenized, then from the cache
        data = load_preference_pairs(path, tok, 32, cache=True)
        assert [p.margin for p in data.examples] == [1.5, None, 0.0]
    assert data.stats.from_cache
    assert collate_pairs(data.examples, 0)["margin"].tolist() == [1.5, 0.0, 0.0]
    assert "margin" not in collate_pairs(data.examples[1:2], 0)
    _jsonl(path, [{**records[0], "margin": "high"}])
    with pytest.raises(DataError, match="'margin' = 'high'"):
        load_preference_pairs(path, tok, 32)


def test_a_reward_model_scores_whole_texts_without_a_shared_beginning(tok: Any, tmp_path: Path) -> None:
    """`{"chosen", "rejected"}` strings that share no beginning: refused for DPO (no implicit prompt), scored
    whole for a reward model (bos, then each text and eos, as TRL's RewardTrainer tokenizes each text)."""
    path = _jsonl(tmp_path / "w.jsonl", [{"chosen": "good answer", "rejected": "bad one"}])
    with pytest.raises(DataError, match="share no beginning"):
        load_preference_pairs(path, tok, 32)
    (pair,) = load_preference_pairs(path, tok, 32, whole_texts=True).examples
    assert pair.chosen.input_ids == [
        tok.bos_token_id,
        *tok.encode("good answer", add_special_tokens=False),
        tok.eos_token_id,
    ]
    assert pair.rejected.input_ids[0] == tok.bos_token_id and pair.rejected.labels[0] == IGNORE_INDEX
