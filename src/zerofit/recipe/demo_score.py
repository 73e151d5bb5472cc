"""Score a trained run against the base model it started from, on held-out prompts: what `make demo` (and
the vision demo) print to show that training taught something and kept what the model knew.

Sets of chat prompts, each a JSON Lines file of `{"prompt": ..., "answer": ...}` (never trained on):

    task    the skill the run trained: a reply passes when it is exactly one JSON object {"answer": "<text>"}
            (the demo's output format, which the base model does not follow unasked)
    facts   what the base model already knew: a reply passes when it contains the expected answer
            (case-insensitive), whatever its format, so a run that forgot a fact fails it
    images  a vision-language run's task (`{"image": ..., "prompt": ..., "answer": ...}`, the image's path
            relative to the file): each image shown before its prompt as `zerofit generate --image` shows it;
            a reply passes when it contains the expected answer (the vision demo: the colour of a shade of
            it training never saw, so only the image can decide it)

Both models answer the same prompts, greedily: the run's trained model, and the base (a LoRA run's weights
with the adapters disabled; a full fine-tuning run's base weights loaded again). A run that trained little
scores as it is: the report prints its numbers as measured and says when the task did not improve (it is not
an error).

    python -m zerofit.recipe.demo_score RUN_DIR --task data/demo_smollm2_heldout.jsonl \
        --facts data/demo_smollm2_facts.jsonl
    python -m zerofit.recipe.demo_score RUN_DIR --images data/demo-vlm-colours-heldout.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError, ZerofitError

# Tokens each reply may take: the task's answers and the facts' sentences fit with room to spare.
MAX_NEW_TOKENS = 40
# Prompts per generate() call: batched decoding, small enough for 2 CPU cores' memory at any vocabulary.
BATCH_SIZE = 16
SAMPLES = 2  # task answers shown before and after
EMPTY = "(empty)"
NO_GAIN = "  The task did not improve: this run trained too little (raise train.max_steps)."
IMAGE_PROBE = '{"image": "<path relative to the file>", "prompt": ..., "answer": ...}'


@dataclass(frozen=True)
class Probe:
    """One held-out prompt and the answer it expects (after `image`, for a vision-language model)."""

    prompt: str
    answer: str
    image: Path | None = None


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
            image = path.parent / str(row["image"]) if row.get("image") is not None else None
            probes.append(Probe(str(row["prompt"]), str(row["answer"]), image))
        except (ValueError, KeyError, TypeError, AttributeError):
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


@contextlib.contextmanager
def _base_model(trained: Any) -> Iterator[Any]:
    """The model the run started from: a LoRA run's model with its adapters disabled, or a full fine-tuning
    run's base weights loaded again."""
    if trained.is_lora:
        with trained.model.disable_adapter():
            yield trained.model
        return
    import torch

    from zerofit.export.trained import load_base

    yield load_base(trained.run.config, torch.float32, "cpu").eval()


def _score_set(
    name: str,
    probes: list[Probe],
    trained: Any,
    check: Callable[[str, Probe], bool],
    replies: Callable[[Any], list[str]],
) -> SetScore:
    """Both models' `replies(model)` to `probes` and `check(reply, probe)`'s verdicts."""
    with _base_model(trained) as base:
        before = replies(base)
    after = replies(trained.model)
    return SetScore(
        name,
        probes,
        before,
        after,
        [check(reply, probe) for reply, probe in zip(before, probes, strict=True)],
        [check(reply, probe) for reply, probe in zip(after, probes, strict=True)],
    )


def _loaded(run_dir: Path) -> Any:
    """The run's trained model (`export.load_trained`), in eval mode."""
    from zerofit.export import load_trained

    trained = load_trained(run_dir)
    trained.model.eval()
    return trained


def score_run(run_dir: Path, task: Path, facts: Path) -> tuple[SetScore, SetScore]:
    """The task and facts scores of the run in `run_dir` (its final weights) against its base model."""
    task_probes, fact_probes = read_probes(task), read_probes(facts)
    trained = _loaded(run_dir)

    def replies(probes: list[Probe]) -> Callable[[Any], list[str]]:
        return lambda model: generate_replies(model, trained.tokenizer, [p.prompt for p in probes])

    return (
        _score_set("task", task_probes, trained, lambda r, p: follows_format(r), replies(task_probes)),
        _score_set("facts", fact_probes, trained, lambda r, p: knows(r, p.answer), replies(fact_probes)),
    )


def score_images(run_dir: Path, images: Path) -> SetScore:
    """The image task's score of the vision-language run in `run_dir` against its base model: each probe's
    image and prompt as one user turn (`zerofit generate --image`'s `Generator`), answered greedily."""
    import torch

    from zerofit.export.generate import Generator
    from zerofit.models.build import resolve_model_path

    probes = read_probes(images)
    unnamed = next((i for i, p in enumerate(probes, 1) if p.image is None), None)
    if unnamed is not None:
        raise DataError(f'{images}: probe {unnamed} names no "image"; each image probe is {IMAGE_PROBE}')
    trained = _loaded(run_dir)
    folder = resolve_model_path(trained.run.config)

    def replies(model: Any) -> list[str]:
        ask = Generator(model, trained.tokenizer, True, torch.device("cpu"), folder)
        return [ask(p.prompt, MAX_NEW_TOKENS, image=p.image).strip() for p in probes]

    return _score_set("images", probes, trained, lambda r, p: knows(r, p.answer), replies)


def _samples(score: SetScore, indices: Sequence[int]) -> list[str]:
    """The prompts at `indices` with the base's and the trained model's replies (`EMPTY` for a reply that
    is only whitespace: a random model's newlines)."""
    lines = []
    for i in indices:
        probe = score.probes[i]
        shown = f"[{probe.image.name}] {probe.prompt}" if probe.image is not None else probe.prompt
        before, after = score.before[i] or EMPTY, score.after[i] or EMPTY
        lines += [f"  Q: {shown}", f"     base:    {before}", f"     trained: {after}"]
    return lines


def format_report(task: SetScore, facts: SetScore) -> str:
    """The before/after lines `make demo` prints: both counts, then sample task answers before and after."""
    (tb, ta), (fb, fa), n, m = task.counts, facts.counts, len(task.probes), len(facts.probes)
    lines = [
        f'Held-out task (answer as {{"answer": "..."}}): base {tb}/{n} -> trained {ta}/{n}',
        f"Held-out facts the base model knows (kept): base {fb}/{m} -> trained {fa}/{m}",
    ]
    lines += _samples(task, range(min(SAMPLES, n)))
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
        lines.append(NO_GAIN)
    return "\n".join(lines)


def format_images_report(score: SetScore) -> str:
    """The vision demo's before/after lines: the count, then one sample per expected answer."""
    (before, after), n = score.counts, len(score.probes)
    firsts = {p.answer: i for i, p in reversed(list(enumerate(score.probes)))}
    lines = [f"Held-out images (shades never trained on): base {before}/{n} -> trained {after}/{n}"]
    lines += _samples(score, sorted(firsts.values()))
    if after <= before:
        lines.append(NO_GAIN)
    return "\n".join(lines)


def _report(args: argparse.Namespace) -> str:
    """The report the arguments ask for: the image task, or the task and the facts."""
    if args.images is not None:
        return format_images_report(score_images(args.run_dir, args.images))
    return format_report(*score_run(args.run_dir, args.task, args.facts))


def main(argv: Sequence[str] | None = None) -> int:
    """Score a run and print the report; a user error is one paragraph (exit 2)."""
    from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries

    parser = argparse.ArgumentParser(
        prog="python -m zerofit.recipe.demo_score", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="a finished run's folder")
    parser.add_argument("--task", type=Path, help="held-out task probes (JSON Lines), with --facts")
    parser.add_argument("--facts", type=Path, help="held-out fact probes (JSON Lines), with --task")
    parser.add_argument("--images", type=Path, help=f"held-out image probes (JSON Lines of {IMAGE_PROBE})")
    args = parser.parse_args(argv)
    text = args.task is not None or args.facts is not None
    if (args.images is not None) == text or (text and (args.task is None or args.facts is None)):
        parser.error("give --task and --facts (a language model's run), or --images (a vision-language run)")
    quiet_deepspeed_on_cpu()
    quiet_libraries()
    try:
        print(_report(args), flush=True)
    except ZerofitError as exc:
        print(f"zerofit: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
