"""Rebuild `data/demo_smollm2.jsonl`, the real demo's training chats, from its questions.

The demo teaches SmolLM2-135M-Instruct a strict output format, one JSON object `{"answer": "..."}`, and
must not teach it facts (right or wrong): each training answer is the base model's own greedy reply to the
question (its first sentence), wrapped in the format. What the run learns is then the format alone, and
what the base model knew (the held-out capitals of `demo_smollm2_facts.jsonl`) stays as it was. Replies
longer than `MAX_TOKENS`, cut mid-sentence or quoting with `"` are left out: every answer is a whole
sentence, and none teaches an escaped quote (`\\"`), which the small model learns as a bare `"` that
breaks the JSON.

    python data/build_demo_smollm2.py     # after `make setup`; rewrites data/demo_smollm2.jsonl (~30 s)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zerofit.models.pretrained import ensure_pretrained

DATA = Path(__file__).resolve().parent / "demo_smollm2.jsonl"
MAX_TOKENS = 24  # of the first sentence: the demo's scorer gives a reply room for this in the format


def base_replies(questions: list[str]) -> list[str]:
    """The base model's greedy reply to each question, rendered with its own chat template."""
    folder = ensure_pretrained("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    chats = [[{"role": "user", "content": q}] for q in questions]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=2 * MAX_TOKENS, do_sample=False)
    return [
        tokenizer.decode(seq, skip_special_tokens=True).strip() for seq in out[:, batch.input_ids.shape[1] :]
    ]


def first_sentence(reply: str, tokenizer: AutoTokenizer) -> str | None:
    """The reply's first whole sentence, or None when it has none within `MAX_TOKENS` or it quotes."""
    match = re.match(r"(.+?[.!?])(\s|$)", reply)
    if match is None or '"' in match.group(1) or len(tokenizer(match.group(1)).input_ids) > MAX_TOKENS:
        return None
    return match.group(1)


def main() -> None:
    """Rewrite `DATA` with the base model's own answers to its questions, in the format."""
    questions = [json.loads(line)["messages"][0]["content"] for line in DATA.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(ensure_pretrained("smollm2-135m-instruct"))
    rows = []
    for question, reply in zip(questions, base_replies(questions), strict=True):
        sentence = first_sentence(reply, tokenizer)
        if sentence is not None:
            answer = json.dumps({"answer": sentence})
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
    DATA.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{DATA}: {len(rows)} of {len(questions)} questions, each answered in the base model's own words")


if __name__ == "__main__":
    main()
