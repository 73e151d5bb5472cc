"""Score a trained LoRA run against the base model it started from, on held-out prompts: what `make demo`
prints to show that training taught something and kept what the model knew.

Two sets of chat prompts, each a JSON Lines file of `{"prompt": ..., "answer": ...}` (never trained on):

    task   the skill the run trained: a reply passes when it is exactly one JSON object {"answer": "<text>"}
           (the demo's output format, which the base model does not follow unasked)
    facts  what the base model already knew: a reply passes when it contains the expected answer
           (case-insensitive), whatever its format, so a run that forgot a fact fails it

Both models answer the same prompts, greedily, in batches: the run's model with its adapters, and the base
(the same weights with the adapters disabled). A run that trained little scores as it is: the report prints
its numbers as measured and says when the task did not improve (it is not an error).

    python -m zerofit.recipe.demo_score RUN_DIR --task data/demo_smollm2_heldout.jsonl \
        --facts data/demo_smollm2_facts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError, DataError, ZerofitError

# Tokens each reply may take: the task's answers and the facts' sentences fit with room to spare.
MAX_NEW_TOKENS = 40
# Prompts per generate() call: batched decoding, small enough for 2 CPU cores' memory at any vocabulary.
BATCH_SIZE = 16
SAMPLES = 2  # task answers shown before and after


@dataclass(frozen=True)
class Probe:
    """One held-out prompt and the answer it expects."""

    prompt: str
    answer: str


@dataclass
class SetScore:
    """One probe set's replies and verdicts, before (base) and after (trained)."""

    name: str
    probes: list[Probe]
    before: list[str]
    after: list[str]
    passed_before: list[bool]
    passed_after: list[bool]

    @property
    def counts(self) -> tuple[int, int]:
        """How many probes passed before and after."""
        return sum(self.passed_before), sum(self.passed_after)


def read_probes(path: Path) -> list[Probe]:
    """The probes of a JSON Lines file; a DataError naming the line for anything else."""
    probes = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the probe file ({exc.strerror or exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            probes.append(Probe(str(row["prompt"]), str(row["answer"])))
        except (ValueError, KeyError, TypeError):
            raise DataError(
                f'{path}:{number}: expected a JSON object {{"prompt": ..., "answer": ...}}'
            ) from None
    if not probes:
        raise DataError(f"{path}: no probes (one JSON object per line, with prompt and answer)")
    return probes


def follows_format(reply: str) -> bool:
    """Whether `reply` is exactly one JSON object with one key, "answer", holding a non-empty string."""
    try:
        value = json.loads(reply.strip())
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"answer"}
        and isinstance(value["answer"], str)
        and bool(value["answer"].strip())
    )


def knows(reply: str, answer: str) -> bool:
    """Whether `reply` contains `answer`, case-insensitively."""
    return answer.lower() in reply.lower()


def generate_replies(
    model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = MAX_NEW_TOKENS
) -> list[str]:
    """Greedy replies of `model` to each prompt as one user turn of the tokenizer's chat template, in
    batches (left-padded, so every row's new tokens start at the same column)."""
    import torch

    tokenizer.padding_side = "left"
    replies: list[str] = []
    for start in range(0, len(prompts), BATCH_SIZE):
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in prompts[start : start + BATCH_SIZE]
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        new = out[:, batch["input_ids"].shape[1] :]
        replies += [text.strip() for text in tokenizer.batch_decode(new, skip_special_tokens=True)]
    return replies


def _score_set(name: str, probes: list[Probe], trained: Any, check: Any) -> SetScore:
    """Both models' replies to `probes` and `check(reply, probe)`'s verdicts."""
    model, tokenizer = trained.model, trained.tokenizer
    prompts = [p.prompt for p in probes]
    with model.disable_adapter():
        before = generate_replies(model, tokenizer, prompts)
    after = generate_replies(model, tokenizer, prompts)
    return SetScore(
        name,
        probes,
        before,
        after,
        [check(reply, probe) for reply, probe in zip(before, probes, strict=True)],
        [check(reply, probe) for reply, probe in zip(after, probes, strict=True)],
    )


def score_run(run_dir: Path, task: Path, facts: Path) -> tuple[SetScore, SetScore]:
    """The task and facts scores of the run in `run_dir` (its final adapter) against its base model."""
    from zerofit.export import load_trained

    task_probes, fact_probes = read_probes(task), read_probes(facts)
    trained = load_trained(run_dir)
    if not trained.is_lora:
        raise ConfigError(
            [f"{run_dir}: lora.enabled=false; the demo's scorer compares a LoRA run with its base"]
        )
    trained.model.eval()
    return (
        _score_set("task", task_probes, trained, lambda reply, probe: follows_format(reply)),
        _score_set("facts", fact_probes, trained, lambda reply, probe: knows(reply, probe.answer)),
    )


def format_report(task: SetScore, facts: SetScore) -> str:
    """The before/after lines `make demo` prints: both counts, then sample task answers before and after."""
    (tb, ta), (fb, fa), n, m = task.counts, facts.counts, len(task.probes), len(facts.probes)
    lines = [
        f'Held-out task (answer as {{"answer": "..."}}): base {tb}/{n} -> trained {ta}/{n}',
        f"Held-out facts the base model knows (kept): base {fb}/{m} -> trained {fa}/{m}",
    ]
    for i in range(min(SAMPLES, n)):
        lines += [
            f"  Q: {task.probes[i].prompt}",
            f"     base:    {task.before[i]}",
            f"     trained: {task.after[i]}",
        ]
    # Both ways: a count that stays the same may be one fact forgotten and another gained.
    for label, before, after in (("Forgotten", True, False), ("Gained", False, True)):
        changed = [
            p.prompt
            for p, b, a in zip(facts.probes, facts.passed_before, facts.passed_after, strict=True)
            if (b, a) == (before, after)
        ]
        if changed:
            lines.append(f"  {label}: {'; '.join(changed)}")
    if ta <= tb:
        lines.append("  The task did not improve: this run trained too little (raise train.max_steps).")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Score a run and print the report; a user error is one paragraph (exit 2)."""
    from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries

    parser = argparse.ArgumentParser(
        prog="python -m zerofit.recipe.demo_score", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="a finished LoRA run's folder")
    parser.add_argument("--task", type=Path, required=True, help="held-out task probes (JSON Lines)")
    parser.add_argument("--facts", type=Path, required=True, help="held-out fact probes (JSON Lines)")
    args = parser.parse_args(argv)
    quiet_deepspeed_on_cpu()
    quiet_libraries()
    try:
        print(format_report(*score_run(args.run_dir, args.task, args.facts)), flush=True)
    except ZerofitError as exc:
        print(f"zerofit: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
