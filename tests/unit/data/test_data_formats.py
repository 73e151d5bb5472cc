"""Data formats: auto-detection, alpaca prompts, text chunking, chat templates with an assistant-only mask checked
token by token (transformers' `{% generation %}` mask and zerofit's prefix rendering, on tiny-llama's
character tokenizer and on a byte-level BPE), and text that is never tokenized whole when it cannot fit."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from zerofit.core.errors import DataError
from zerofit.data import IGNORE_INDEX, load_examples, set_chat_template
from zerofit.data import tokenize as tokenize_module
from zerofit.data.chat import has_generation_marks, tokenize_conversation
from zerofit.data.formats import ALPACA_PROMPT_NO_INPUT, alpaca_prompt
from zerofit.data.sft import document_chunks
from zerofit.data.tokenize import SLACK_TOKENS, encode_document, encode_head, text_within
from zerofit.models.tiny import CHAT_TEMPLATE, ensure_tiny_llama

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "add: 1+2"},
    {"role": "assistant", "content": "3"},
]
SHAREGPT = [
    {"from": "system", "value": "be brief"},
    {"from": "human", "value": "hi"},
    {"from": "gpt", "value": "yo"},
    {"from": "human", "value": "add: 1+2"},
    {"from": "gpt", "value": "3"},
]
# ChatML without `{% generation %}` marks, as most shipped templates are: zerofit finds assistant turns itself.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_llama(0))


@pytest.fixture(scope="module")
def bpe() -> Any:
    """A byte-level BPE tokenizer (the kind Llama-3, Qwen and GPT models use), trained here in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(1, 9))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(300)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials[2:],
        chat_template=CHATML,
    )


def _jsonl(tmp_path: Path, records: list[dict[str, Any]], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _segments(tok: Any, parts: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Expected (ids, labels) from text segments and whether each is learned: tiny-llama has one token per
    character, and `<s>` / `</s>` are one token each."""
    ids: list[int] = []
    labels: list[int] = []
    for text, learned in parts:
        for piece in re.findall(r"</?s>|[\s\S]", text):
            token = tok.convert_tokens_to_ids(piece)
            ids.append(token)
            labels.append(token if learned else IGNORE_INDEX)
    return ids, labels


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"prompt": "a", "response": "b"}, "prompt_response"),
        ({"instruction": "a", "input": "", "output": "b"}, "alpaca"),
        ({"messages": CHAT}, "messages"),
        ({"conversations": SHAREGPT}, "messages"),
        ({"text": "abc", "meta": 1}, "text"),
        ({"text": "abc", "messages": CHAT}, "messages"),  # the richer format wins
    ],
)
def test_auto_detects_each_format(tmp_path: Path, tok: Any, record: dict[str, Any], expected: str) -> None:
    data = load_examples(_jsonl(tmp_path, [record]), tok, 256)
    assert data.stats.format == expected and data.stats.detected


def test_undetectable_record_lists_what_was_seen_and_what_fits(tmp_path: Path, tok: Any) -> None:
    path = _jsonl(tmp_path, [{"question": "a", "answer": "b", "output": "c"}])
    with pytest.raises(DataError) as err:
        load_examples(path, tok, 64)
    msg = str(err.value)
    assert f"{path}:1: cannot tell the data format" in msg
    assert "'question', 'answer', 'output'" in msg  # what was seen
    assert "for alpaca: missing key 'instruction'" in msg  # the closest miss
    for needs in ("'messages' (OpenAI) or 'conversations' (ShareGPT)", "'prompt' and 'response'", "'text'"):
        assert needs in msg
    assert "data.format" in msg


def test_an_explicit_format_checks_every_record(tmp_path: Path, tok: Any) -> None:
    path = _jsonl(tmp_path, [{"text": "abc"}, {"prompt": "x", "response": "y"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing key 'text'"):
        load_examples(path, tok, 64)  # detected from line 1: text
    with pytest.raises(DataError, match=r"d\.jsonl:1: missing key 'prompt'"):
        load_examples(path, tok, 64, format="prompt_response")


# ---------------------------------------------------------------- alpaca and text


def test_alpaca_uses_the_alpaca_prompt_and_learns_only_the_output(tmp_path: Path, tok: Any) -> None:
    records = [
        {"instruction": "say hi", "output": "hi"},
        {"instruction": "add", "input": "1+2", "output": "3"},
    ]
    data = load_examples(_jsonl(tmp_path, records), tok, 512)
    no_input, with_input = data.examples
    expected = _segments(
        tok, [("<s>" + ALPACA_PROMPT_NO_INPUT.format(instruction="say hi"), False), ("hi</s>", True)]
    )
    assert (no_input.input_ids, no_input.labels) == expected
    expected = _segments(tok, [("<s>" + alpaca_prompt("add", "1+2"), False), ("3</s>", True)])
    assert (with_input.input_ids, with_input.labels) == expected
    assert "### Input:\n1+2\n\n### Response:\n" in alpaca_prompt("add", "1+2")


def test_text_is_cut_into_chunks_that_learn_every_token(tmp_path: Path, tok: Any) -> None:
    text = "".join(chr(97 + i % 26) for i in range(70))
    data = load_examples(_jsonl(tmp_path, [{"text": text}, {"text": "short"}, {"text": ""}]), tok, 32)
    ids = [e.input_ids for e in data.examples]
    # <s> + 70 + </s> = 72 tokens; each chunk starts with the last token of the one before (whose label
    # the loss skips at position 0), so 32 + 31 + 9 = 72 tokens, every one after <s> predicted once.
    assert [len(x) for x in ids] == [32, 32, 10, 7]  # and <s>short</s>
    assert ids[0][-1] == ids[1][0] and ids[1][-1] == ids[2][0]
    assert ids[0] + ids[1][1:] + ids[2][1:] == _segments(tok, [("<s>" + text + "</s>", True)])[0]
    assert all(e.labels == e.input_ids for e in data.examples)
    assert data.records == [0, 0, 0, 1]  # the chunks of one document share its record
    assert (data.stats.n_split, data.stats.n_dropped, data.stats.n_truncated) == (1, 1, 0)  # "" is dropped


def test_eos_never_ends_up_alone(tok: Any) -> None:
    # <s> + 31 characters = 32 tokens exactly: eos is learned after the last character, not dropped alone.
    chunks = document_chunks(tok, "x" * 31, 32)
    assert [len(c) for c in chunks] == [32, 2] and chunks[-1] == [chunks[0][-1], tok.eos_token_id]


def test_a_text_ending_in_eos_gets_no_second_one(tok: Any) -> None:
    assert document_chunks(tok, "ab</s>", 32) == document_chunks(tok, "ab", 32) == [[1, 71, 72, 2]]


def test_a_document_tokenized_in_windows_equals_it_tokenized_whole(
    bpe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(1)
    text = "\n".join(
        " ".join(rng.choice(["abc", "def", "ghij", "klm  nop", "a"]) for _ in range(40)) for _ in range(30)
    )
    monkeypatch.setattr(tokenize_module, "WINDOW_CHARS", 97)  # dozens of windows, each cut before whitespace
    windows = list(encode_document(bpe, text))
    assert len(windows) > 20
    assert [t for window in windows for t in window] == bpe.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- text too long to fit


def test_a_long_text_is_tokenized_only_as_far_as_the_sequence_reaches(bpe: Any) -> None:
    rng = random.Random(2)
    text = " ".join(rng.choice(["abc", "defgh", "ij", "klmnop"]) for _ in range(20_000))
    whole = bpe.encode(text, add_special_tokens=False)
    seen: list[int] = []
    original = bpe.encode

    def counting(t: str, **kwargs: Any) -> list[int]:
        seen.append(len(t))
        return original(t, **kwargs)

    bpe.encode = counting
    try:
        head, cut = encode_head(bpe, text, 64)
        kept = text_within(bpe, text, 64)
    finally:
        del bpe.encode
    assert cut and head == whole[:64]  # the same tokens as tokenizing it all
    assert max(seen) < 2_000 < len(text)  # ... from a few hundred characters of 100,000
    assert len(bpe.encode(kept, add_special_tokens=False)) >= 64 + SLACK_TOKENS and text.startswith(kept)
    assert encode_head(bpe, "abc def", 64) == (bpe.encode("abc def", add_special_tokens=False), False)


def _peak_rss_mib(fn: Any) -> float:
    """Peak resident memory above the starting point while `fn()` runs (Linux: VmHWM reset via clear_refs)."""
    status = Path("/proc/self/status")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to measure peak memory")

    def field(name: str) -> float:
        return int(re.search(rf"{name}:\s+(\d+)", status.read_text()).group(1)) / 1024  # type: ignore[union-attr]

    before = field("VmRSS")
    fn()
    return field("VmHWM") - before


@pytest.mark.parametrize("kind", ["prompt_response", "messages"])
def test_a_50_mb_line_loads_in_little_memory(tmp_path: Path, tok: Any, kind: str) -> None:
    """Tokenized whole, a 50 MB line needed about 19 GB (tiny-llama: ~390 bytes per character); it keeps 512."""
    body = "abcdefghi " * 5_000_000
    record = (
        {"prompt": "q", "response": body}
        if kind == "prompt_response"
        else {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": body}]}
    )
    path = _jsonl(tmp_path, [record])
    del body, record
    assert path.stat().st_size > 50_000_000
    out: list[Any] = []
    peak = _peak_rss_mib(lambda: out.append(load_examples(path, tok, 512)))
    (example,) = out[0].examples
    assert len(example.input_ids) == 512 and out[0].stats.n_truncated == 1
    assert peak < 600, f"{peak:.0f} MiB above the baseline"  # measured: ~145 MiB (the line, parsed)


# ---------------------------------------------------------------- chat


def test_every_assistant_turn_and_only_those_are_learned(tmp_path: Path, tok: Any) -> None:
    data = load_examples(_jsonl(tmp_path, [{"messages": CHAT}]), tok, 256)
    (example,) = data.examples
    expected = _segments(
        tok,
        [
            ("<s>s: be brief\nu: hi\na: ", False),
            ("yo</s>", True),
            ("u: add: 1+2\na: ", False),
            ("3</s>", True),
        ],
    )
    assert (example.input_ids, example.labels) == expected  # token by token


def test_sharegpt_and_openai_messages_give_the_same_example(tmp_path: Path, tok: Any) -> None:
    openai = load_examples(_jsonl(tmp_path, [{"messages": CHAT}], "a.jsonl"), tok, 256).examples
    sharegpt = load_examples(_jsonl(tmp_path, [{"conversations": SHAREGPT}], "b.jsonl"), tok, 256).examples
    assert openai == sharegpt


def test_prefix_rendering_finds_the_same_tokens_as_generation_marks(tok: Any) -> None:
    marked = tokenize_conversation(tok, CHAT, 256, "w")
    tok.chat_template = CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert not has_generation_marks(tok.chat_template)
    assert tokenize_conversation(tok, CHAT, 256, "w") == marked


def test_a_chatml_template_without_marks_on_a_bpe_tokenizer(bpe: Any) -> None:
    messages = [
        *CHAT,
        {"role": "user", "content": "abc def"},
    ]  # ends on a user turn: nothing after it learned
    ids, mask, truncated = tokenize_conversation(bpe, messages, 512, "w")
    assert (
        not truncated
        and ids == bpe.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    )
    learned = [bpe.decode(ids[a:b]) for a, b in _runs(mask)]
    assert learned == ["yo<|im_end|>\n", "3<|im_end|>\n"]  # each assistant turn up to the next turn's start


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_truncation_keeps_the_mask_of_what_is_left(tmp_path: Path, tok: Any) -> None:
    data = load_examples(_jsonl(tmp_path, [{"messages": CHAT}]), tok, 28)
    (example,) = data.examples
    full = _segments(
        tok, [("<s>s: be brief\nu: hi\na: ", False), ("yo</s>", True), ("u: add: 1+2\na: ", False)]
    )
    assert (example.input_ids, example.labels) == (full[0][:28], full[1][:28])
    assert data.stats.n_truncated == 1


def test_conversations_without_an_assistant_turn_are_dropped(tmp_path: Path, tok: Any) -> None:
    records = [{"messages": CHAT}, {"messages": CHAT[:2]}]
    assert load_examples(_jsonl(tmp_path, records), tok, 256).stats.n_dropped == 1
    with pytest.raises(DataError, match=r"all 1 conversations were dropped.*assistant"):
        load_examples(_jsonl(tmp_path, records[1:]), tok, 256)


def test_no_chat_template_says_how_to_supply_one(tmp_path: Path, tok: Any) -> None:
    path = _jsonl(tmp_path, [{"messages": CHAT}])
    tok.chat_template = None
    with pytest.raises(DataError) as err:
        load_examples(path, tok, 256)
    assert (
        "has none" in str(err.value)
        and "data.chat_template" in str(err.value)
        and str(path) in str(err.value)
    )
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    set_chat_template(tok, str(template_file))  # what `data.chat_template=chat.jinja` does
    assert load_examples(path, tok, 256).stats.n_examples == 1


def test_a_template_that_refuses_the_conversation_names_the_record(tmp_path: Path, tok: Any) -> None:
    set_chat_template(
        tok, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    )
    with pytest.raises(
        DataError, match=r"d\.jsonl:1: the chat template refused this conversation \(user first\)"
    ):
        load_examples(_jsonl(tmp_path, [{"messages": CHAT}]), tok, 256)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path, tok: Any) -> None:
    # Renders the turn count first: a conversation's beginning changes as turns are added.
    set_chat_template(tok, "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match=r"not prefix-stable.*\{% generation %\}"):
        load_examples(_jsonl(tmp_path, [{"messages": CHAT}]), tok, 256)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ("hi", "'messages' must be a list"),
        ([{"role": "user"}], "message 0 has keys 'role'"),
        ([{"from": "alien", "value": "x"}], "from 'alien'"),
        ([{"role": "user", "content": 3}], "message 0 has content of type int"),
    ],
)
def test_bad_messages_name_the_record(tmp_path: Path, tok: Any, messages: Any, needle: str) -> None:
    with pytest.raises(DataError, match=rf"d\.jsonl:1: .*{re.escape(needle)}"):
        load_examples(_jsonl(tmp_path, [{"messages": messages}]), tok, 256, format="messages")
