"""Write data/demo.jsonl: short instruction/response pairs a tiny character-level model can visibly learn.

Four tasks over short random strings and numbers (copy, reverse, upper-case, two-number addition), with
varied lengths so padding and token-weighted loss matter. Seeded: running it again writes the same bytes.
`--chat` writes the same tasks as multi-turn chat instead (data/demo_chat.jsonl, `messages` format: 1-3
user/assistant turns, some with a system message). `--preference` writes preference pairs of the same
tasks (data/demo_preference.jsonl, TRL's `{prompt, chosen, rejected}` layout, for `train.objective: dpo`):
the correct response chosen, rejected a clearly wrong one of about its length (punctuation garbage), so a
tiny random-init model learns to prefer the right one within a few dozen steps; with `--chat` too, the
same pairs conversational (data/demo_preference_chat.jsonl: prompt a user message, chosen / rejected one
assistant message each). `--kto` writes unpaired feedback of the same tasks (data/demo_kto.jsonl, TRL's
`{prompt, completion, label}` layout, for `train.objective: kto`): about 60% the correct response with label
true, the rest garbage with label false (an unbalanced mix, as real thumbs-up / thumbs-down data is).

    python data/make_demo_data.py [--n 3000] [--seed 0] [--out data/demo.jsonl]
    python data/make_demo_data.py --chat --n 1000 --out data/demo_chat.jsonl
    python data/make_demo_data.py --preference --n 600 --out data/demo_preference.jsonl
    python data/make_demo_data.py --preference --chat --n 300 --out data/demo_preference_chat.jsonl
    python data/make_demo_data.py --kto --n 600 --out data/demo_kto.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

LETTERS = string.ascii_lowercase
GARBAGE = "!#$%&*+?@^~"  # what a rejected response is made of: no task ever answers with these


def _word(rng: random.Random) -> str:
    """A random lower-case string of 1-12 letters (lengths vary so examples differ in token count)."""
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 12)))


def copy_task(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"copy: {w}\n", w


def reverse_task(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"reverse: {w}\n", w[::-1]


def upper_task(rng: random.Random) -> tuple[str, str]:
    w = _word(rng)
    return f"upper: {w}\n", w.upper()


def add_task(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"add: {a}+{b}\n", str(a + b)


TASKS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    copy_task,
    reverse_task,
    upper_task,
    add_task,
)


def make_pairs(n: int, seed: int) -> list[dict[str, str]]:
    """`n` pairs cycling through the tasks in a seeded random order."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt, response = rng.choice(TASKS)(rng)
        pairs.append({"prompt": prompt, "response": response})
    return pairs


def make_conversations(n: int, seed: int) -> list[dict[str, list[dict[str, str]]]]:
    """`n` conversations of 1-3 task turns each; about one in five opens with a system message."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        messages = [{"role": "system", "content": "be exact"}] if rng.random() < 0.2 else []
        for _ in range(rng.randint(1, 3)):
            prompt, response = rng.choice(TASKS)(rng)
            messages.append({"role": "user", "content": prompt.rstrip("\n")})
            messages.append({"role": "assistant", "content": response})
        conversations.append({"messages": messages})
    return conversations


def _garbage(rng: random.Random, like: str) -> str:
    """A wrong answer about as long as `like` (within two characters either way), of punctuation only."""
    return "".join(rng.choice(GARBAGE) for _ in range(max(1, len(like) + rng.randint(-2, 2))))


def make_preferences(n: int, seed: int, chat: bool = False) -> list[dict[str, Any]]:
    """`n` preference pairs of the tasks: the correct response chosen, garbage of its length rejected;
    conversational (`chat`): the prompt a user message, each response one assistant message."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for _ in range(n):
        prompt, response = rng.choice(TASKS)(rng)
        wrong = _garbage(rng, response)
        if chat:
            records.append(
                {
                    "prompt": [{"role": "user", "content": prompt.rstrip("\n")}],
                    "chosen": [{"role": "assistant", "content": response}],
                    "rejected": [{"role": "assistant", "content": wrong}],
                }
            )
        else:
            records.append({"prompt": prompt, "chosen": response, "rejected": wrong})
    return records


def make_unpaired(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` unpaired examples of the tasks: the correct response labelled true (desirable) with probability
    0.6, else garbage of its length labelled false (undesirable)."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for _ in range(n):
        prompt, response = rng.choice(TASKS)(rng)
        good = rng.random() < 0.6
        records.append(
            {"prompt": prompt, "completion": response if good else _garbage(rng, response), "label": good}
        )
    return records


def _default_out(chat: bool, preference: bool) -> Path:
    name = "demo" + ("_preference" if preference else "") + ("_chat" if chat else "") + ".jsonl"
    return Path(__file__).resolve().parent / name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="number of pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: data/demo.jsonl or data/demo_chat.jsonl"
    )
    parser.add_argument("--chat", action="store_true", help="multi-turn chat (messages format)")
    parser.add_argument(
        "--preference", action="store_true", help="preference pairs (prompt, chosen, rejected)"
    )
    parser.add_argument("--kto", action="store_true", help="unpaired feedback (prompt, completion, label)")
    args = parser.parse_args()
    records: list[Any]
    if args.kto:
        records, what = make_unpaired(args.n, args.seed), "unpaired examples"
        args.out = args.out or Path(__file__).resolve().parent / "demo_kto.jsonl"
    elif args.preference:
        records, what = make_preferences(args.n, args.seed, args.chat), "preference pairs"
    elif args.chat:
        records, what = make_conversations(args.n, args.seed), "conversations"
    else:
        records, what = make_pairs(args.n, args.seed), "pairs"
    out = args.out or _default_out(args.chat, args.preference)
    lines = [json.dumps(r, ensure_ascii=True) for r in records]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} {what} to {out}")


if __name__ == "__main__":
    main()
