"""Write data/demo_grpo.jsonl and data/demo_grpo_heldout.jsonl: prompts of a verifiable task for GRPO
(`train.objective: grpo`, configs/demo-grpo.yaml) that the built-in tiny character-level model can learn by
reward alone.

The task: single-digit sums, "add: 3+4\n" -> "7" (every a + b <= 9 with a, b in 0..9: 55 prompts). The
records are TRL's GRPO layout, `{"prompt": ..., "answer": ...}`: the `answer` column reaches the reward
functions (exact_match reads it). One answer is a single character, so a random-init model that emits one
digit is right about one time in ten: a group of 8 completions usually holds a right and a wrong one, the
signal GRPO's group-relative advantage needs. A seeded shuffle holds out `--heldout` prompts (never trained
on) for the held-out reward. Running it again writes the same bytes.

    python data/make_demo_grpo.py [--seed 0] [--heldout 10]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def records() -> list[dict[str, str]]:
    """Every single-digit sum whose result is one digit, as a prompt and its answer."""
    return [{"prompt": f"add: {a}+{b}\n", "answer": str(a + b)} for a in range(10) for b in range(10 - a)]


def write(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", type=int, default=10)
    args = parser.parse_args()
    rows = records()
    random.Random(args.seed).shuffle(rows)
    write(HERE / "demo_grpo_heldout.jsonl", rows[: args.heldout])
    write(HERE / "demo_grpo.jsonl", rows[args.heldout :])


if __name__ == "__main__":
    main()
