"""Tool-calling conversations: `tools`, assistant `tool_calls` and `tool` results in the OpenAI and the
ShareGPT layout, rendered by the family's real template (tiny-qwen2: Qwen2.5's, tiny-llama3: Llama 3.1's) with
`tools=`; the loss mask checked against the rendered text; a template that cannot render tools refused; the
loss of a global batch of ragged tool conversations the same whatever the micro-batch split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.core.errors import DataError
from zerofit.data import Example, collate, load_examples, set_chat_template
from zerofit.data.chat import tokenize_conversation
from zerofit.data.formats import parse_record
from zerofit.loop.train import train_step
from zerofit.token_loss.sums import count_label_tokens, token_sum_loss

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "data" / "demo_tools.jsonl"

_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
REVERSE = {"name": "reverse", "description": "Reverse a text.", "parameters": _TEXT}
UPPER = {"name": "upper", "description": "Upper-case a text.", "parameters": _TEXT}
OPENAI = {
    "tools": [{"type": "function", "function": REVERSE}, {"type": "function", "function": UPPER}],
    "messages": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "reverse abc then upper xyz"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "reverse", "arguments": '{"text": "abc"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "reverse", "content": "cba"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "upper", "arguments": {"text": "xyz"}}}],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "XYZ"},
        {"role": "assistant", "content": "cba and XYZ."},
    ],
}
# The same conversation as LLaMA-Factory writes ShareGPT: tools a JSON string of bare schemas.
SHAREGPT = {
    "tools": json.dumps([REVERSE, UPPER]),
    "conversations": [
        {"from": "system", "value": "Use the tools."},
        {"from": "human", "value": "reverse abc then upper xyz"},
        {"from": "function_call", "value": '{"name": "reverse", "arguments": {"text": "abc"}}'},
        {"from": "observation", "value": "cba"},
        {"from": "function_call", "value": '{"name": "upper", "arguments": "{\\"text\\": \\"xyz\\"}"}'},
        {"from": "observation", "value": "XYZ"},
        {"from": "gpt", "value": "cba and XYZ."},
    ],
}
# What each family's real template writes for the assistant turns: the labelled text, span by span.
LEARNED = {
    "tiny-qwen2": [
        '<tool_call>\n{"name": "reverse", "arguments": {"text": "abc"}}\n</tool_call><|im_end|>\n',
        '<tool_call>\n{"name": "upper", "arguments": {"text": "xyz"}}\n</tool_call><|im_end|>\n',
        "cba and XYZ.<|im_end|>\n",
    ],
    "tiny-llama3": [
        '{"name": "reverse", "parameters": {"text": "abc"}}<|eot_id|>',
        '{"name": "upper", "parameters": {"text": "xyz"}}<|eot_id|>',
        "cba and XYZ.<|eot_id|>",
    ],
}
# Text of the tools preamble and of the tool results: rendered, never learned.
PREAMBLE = {"tiny-qwen2": "# Tools", "tiny-llama3": "Given the following functions"}


def _tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    from zerofit.models.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model(name, 0))


def _tokenize(tokenizer: Any, record: dict[str, Any]) -> tuple[list[int], list[bool]]:
    parsed = parse_record("messages", record, "test:1")
    ids, mask, truncated = tokenize_conversation(tokenizer, parsed.messages, 2048, "test:1", parsed.tools)
    assert not truncated
    return ids, mask


def _spans(tokenizer: Any, ids: list[int], mask: list[bool]) -> list[str]:
    """The labelled tokens, decoded run by run."""
    runs: list[list[int]] = []
    for k, (token, learned) in enumerate(zip(ids, mask, strict=True)):
        if learned:
            if k == 0 or not mask[k - 1]:
                runs.append([])
            runs[-1].append(token)
    return [tokenizer.decode(r) for r in runs]


@pytest.mark.parametrize("name", list(LEARNED))
def test_the_loss_is_on_the_assistant_turns_and_their_tool_calls_only(name: str) -> None:
    """The rendered text is the template's own with `tools=` (arguments given as a JSON string written as the
    object the template expects); the labelled tokens are exactly the tool calls and the answer with their
    turn ends; the tools preamble, the user turn and the tool results are rendered but not learned."""
    tokenizer = _tokenizer(name)
    ids, mask = _tokenize(tokenizer, OPENAI)
    parsed = parse_record("messages", OPENAI, "test:1")
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
        parsed.messages, tools=parsed.tools, tokenize=False
    )
    rendered = tokenizer.decode(ids)
    assert PREAMBLE[name] in rendered and "cba" in rendered and '"description": "Reverse a text."' in rendered
    spans = _spans(tokenizer, ids, mask)
    assert spans == LEARNED[name]
    unlearned = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert PREAMBLE[name] in unlearned and "reverse abc then upper xyz" in unlearned
    assert unlearned.count("XYZ") == 1 and "Use the tools." in unlearned  # the tool result, not the answer


@pytest.mark.parametrize("name", list(LEARNED))
def test_the_openai_and_sharegpt_layouts_give_the_same_tokens(name: str) -> None:
    tokenizer = _tokenizer(name)
    assert _tokenize(tokenizer, OPENAI) == _tokenize(tokenizer, SHAREGPT)


def test_parallel_calls_in_one_turn_are_read_from_either_layout() -> None:
    """Two calls in one assistant turn (Qwen2.5 writes both; OpenAI's list, ShareGPT's JSON list)."""
    calls = [{"name": "reverse", "arguments": {"text": "abc"}}, {"name": "upper", "arguments": {"text": "x"}}]
    openai = {
        "tools": [REVERSE, UPPER],  # bare schemas are wrapped as {"type": "function", "function": ...}
        "messages": [
            {"role": "user", "content": "both"},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": c} for c in calls]},
            {"role": "tool", "content": "cba"},
            {"role": "tool", "content": "X"},
            {"role": "assistant", "content": "done"},
        ],
    }
    sharegpt = {
        "tools": [{"type": "function", "function": REVERSE}, {"type": "function", "function": UPPER}],
        "conversations": [
            {"from": "human", "value": "both"},
            {"from": "function_call", "value": json.dumps(calls)},
            {"from": "observation", "value": "cba"},
            {"from": "observation", "value": "X"},
            {"from": "gpt", "value": "done"},
        ],
    }
    tokenizer = _tokenizer("tiny-qwen2")
    ids, mask = _tokenize(tokenizer, openai)
    assert (ids, mask) == _tokenize(tokenizer, sharegpt)
    first = _spans(tokenizer, ids, mask)[0]
    assert first.count("<tool_call>") == 2 and "<tool_response>" not in first


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_a_template_that_cannot_render_tools_is_refused_naming_the_model_and_the_fix(name: str) -> None:
    """tiny-llama's one-letter template and the simplified ChatML of tiny-qwen3 ignore `tools` and drop
    `tool_calls`: one paragraph naming the model, what was left out and both fixes; data.chat_template with
    a template that renders tools (Qwen2.5's) makes the same data train."""
    tokenizer = _tokenizer(name)
    with pytest.raises(DataError) as info:
        load_examples(DEMO, tokenizer, 1024)
    message = str(info.value)
    assert f"{name}-seed0" in message and "demo_tools.jsonl:1" in message
    assert "left out the tool definitions (tools=), the assistant's tool call (tool_calls)" in message
    assert "data.chat_template" in message and "tiny-qwen2" in message and "\n" not in message
    set_chat_template(tokenizer, str(REPO / "src" / "zerofit" / "models" / "templates" / "qwen2_5.jinja"))
    assert load_examples(DEMO, tokenizer, 1024).stats.n_examples == 48


def test_bad_tool_data_is_one_paragraph_naming_the_message() -> None:
    broken = {**OPENAI, "messages": [dict(m) for m in OPENAI["messages"]]}
    broken["messages"][2] = {
        **broken["messages"][2],
        "tool_calls": [{"function": {"name": "reverse", "arguments": "{text"}}],
    }
    with pytest.raises(
        DataError, match=r"test:1: message 2's tool-call arguments is a string that is not valid JSON"
    ):
        parse_record("messages", broken, "test:1")
    with pytest.raises(DataError, match=r"test:1: 'tools' must be a list of function schemas"):
        parse_record("messages", {**OPENAI, "tools": {"name": "x"}}, "test:1")
    with pytest.raises(DataError, match=r"test:1: tool 0 .* is no function schema"):
        parse_record("messages", {**OPENAI, "tools": [{"description": "no name"}]}, "test:1")


def test_data_tools_file_gives_the_tools_of_records_without_their_own(tmp_path: Path) -> None:
    """`data.tools_file`: one set of tools for a data set; a record's own `tools` still win; an unreadable or
    empty file is one paragraph naming the key."""
    from zerofit.config import load_config
    from zerofit.data.tools import read_tools_file

    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(OPENAI["tools"]))
    (tmp_path / "bare.jsonl").write_text(json.dumps({"messages": OPENAI["messages"]}) + "\n")
    (tmp_path / "own.jsonl").write_text(json.dumps(OPENAI) + "\n")
    tokenizer = _tokenizer("tiny-qwen2")
    shared = load_examples(tmp_path / "bare.jsonl", tokenizer, 2048, tools=read_tools_file(str(tools_file)))
    own = load_examples(tmp_path / "own.jsonl", tokenizer, 2048, tools=[{"name": "other"}])
    assert shared.examples == own.examples
    cfg = load_config(REPO / "configs" / "demo-tools.yaml", [f"data.tools_file={tools_file}"])
    assert cfg.data.tools_file == str(tools_file)
    with pytest.raises(DataError, match=r"data.tools_file = '.*nothing.json': cannot read it"):
        read_tools_file(str(tmp_path / "nothing.json"))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match=r"data.tools_file = .*: the file holds no tools"):
        read_tools_file(str(tmp_path / "empty.json"))


def test_the_demo_data_trains_whole_and_keeps_every_tool_call_turn() -> None:
    """data/demo_tools.jsonl (both layouts) through the SFT loader with tiny-qwen2 at the demo config's
    max_seq_len: every conversation kept (a tool-call turn with empty content is no empty response), none cut."""
    data = load_examples(DEMO, _tokenizer("tiny-qwen2"), 1280)
    stats = data.stats
    assert (stats.n_examples, stats.n_dropped, stats.n_truncated, stats.format) == (48, 0, 0, "messages")


# -- the loss of a global batch does not depend on its split -------------------------------------------------


@pytest.fixture(scope="module")
def ragged() -> list[Example]:
    """8 demo tool conversations of different lengths (one call, two calls, no call) through tiny-qwen2."""
    examples = load_examples(DEMO, _tokenizer("tiny-qwen2"), 1280).examples[:8]
    assert len({len(e.input_ids) for e in examples}) >= 4
    return examples


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from zerofit.models.tiny import ensure_tiny_model

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model("tiny-qwen2", 0), dtype=torch.float32)


def _curve(examples: list[Example], micro: int, steps: int = 2) -> tuple[list[float], torch.nn.Module]:
    """The losses of `steps` AdamW steps on the global batch `examples` in micro-batches of `micro`, and the
    model they leave."""
    model = _model()
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-2),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    batches = [collate(examples[k : k + micro], pad_id=0) for k in range(0, len(examples), micro)]
    return [train_step(strategy, model, batches, max_grad_norm=1.0).loss for _ in range(steps)], model


@pytest.mark.slow
def test_the_loss_curve_is_the_same_for_8x1_and_2x4_and_per_micro_batch_means_disagree(
    ragged: list[Example],
) -> None:
    """One process, fp32, AdamW steps on the same global batch: 8 micro-batches of 1 and 2 of 4 give the same
    losses within 2e-5 (one normalizer, the global batch's label tokens). On the model they leave, the mean
    of the per-micro-batch means is another number than the global batch's token mean on this ragged data."""
    (one, model), (four, _) = _curve(ragged, 1), _curve(ragged, 4)
    assert max(abs(a - b) for a, b in zip(one, four, strict=True)) < 2e-5, (one, four)
    assert one[-1] < one[0]
    with torch.no_grad():
        sums, counts = [], []
        for k in (0, 4):
            batch = collate(ragged[k : k + 4], pad_id=0)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sums.append(float(token_sum_loss(logits, batch["labels"])))
            counts.append(count_label_tokens(batch["labels"]))
    naive = sum(s / c for s, c in zip(sums, counts, strict=True)) / 2
    assert abs(naive - sum(sums) / sum(counts)) > 1e-3, (naive, sum(sums) / sum(counts))
