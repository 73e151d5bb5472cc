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

Both models answer the same prompts, greedily, in one batch each: the run's model with its adapters, and the
base (the same weights with the adapters disabled). A reply stops where its verdict is settled (a format
reply that did not open with `{`, a fact reply that named the answer; `Check`) as well as at eos, and leaves
the batch: the verdicts are those of the whole replies, in about half the time (the two replies the report
shows are generated whole). A run that trained little scores as it is: the report prints its numbers as
measured and says when the task did not improve (it is not an error). The scoring says where it is while it
runs (`zerofit.core.progress`: a line every 10 s off a terminal).

    python -m zerofit.demo.score RUN_DIR --task data/demo_smollm2_heldout.jsonl \
        --facts data/demo_smollm2_facts.jsonl
    python -m zerofit.demo.score RUN_DIR --images data/demo-vlm-colours-heldout.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError, DataError, ZerofitError
from zerofit.core.progress import Progress, progress
from zerofit.harness.checks import follows_format, knows

# Tokens each reply may take: the task's answers and the facts' sentences fit with room to spare.
MAX_NEW_TOKENS = 40
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


def format_settled(reply: str) -> bool:
    """Whether no continuation of `reply` can change `follows_format`'s verdict: it fails for good once its
    first non-blank character is not `{` (no JSON object starts otherwise), or once a complete JSON value is
    followed by more than blanks. A reply ending in an unfinished character (a token of a multi-byte one
    decodes to U+FFFD) is not settled yet: the character may turn out blank."""
    text = reply.lstrip()
    if not text or text.endswith("\ufffd"):
        return False
    if text[0] != "{":
        return True
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return False
    return bool(text[end:].strip())


@dataclass(frozen=True)
class Check:
    """A probe set's verdict on a reply, and when a reply's verdict is settled before the reply ends (the
    scorer stops generating that reply there: its verdict is what the whole reply's would be)."""

    passes: Callable[[str, Probe], bool]
    settled: Callable[[str, Probe], bool]


TASK_CHECK = Check(lambda reply, probe: follows_format(reply), lambda reply, probe: format_settled(reply))
# A reply that names the answer passes whatever follows; one that does not yet may still name it.
FACTS_CHECK = Check(
    lambda reply, probe: knows(reply, probe.answer), lambda reply, probe: knows(reply, probe.answer)
)


def generate_replies(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = MAX_NEW_TOKENS,
    *,
    settled: Sequence[Callable[[str], bool] | None] | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """Greedy replies of `model` to each prompt as one user turn of the tokenizer's chat template, all in one
    left-padded batch, token by token with the KV cache (as `generate` decodes greedily: the same forward,
    positions counted over real tokens, argmax of the last position's logits).

    A reply ends at eos, at `max_new_tokens`, or once `settled[i]` (None: never) says its verdict can no
    longer change: its tokens up to there are the ones the whole reply starts with. An ended row leaves the
    batch (its cache rows too), so a long reply (one shown in full, one that never names its answer) does not
    keep the others generating. `progress` counts replies: an ended one 1, one still going the share of
    `max_new_tokens` it has generated, so the count (and the time left) moves at every token."""
    import torch

    rules = [rule or _never for rule in (settled or [None] * len(prompts))]
    state = progress if progress is not None else Progress("replies", len(prompts))
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    replies: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        _greedy(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            tokenizer,
            rules,
            replies,
            max_new_tokens,
            state,
        )
    return [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in replies]


def _never(reply: str) -> bool:
    return False


def _greedy(
    model: Any,
    ids: Any,
    mask: Any,
    tokenizer: Any,
    rules: list[Callable[[str], bool]],
    replies: list[list[int]],
    max_new_tokens: int,
    progress: Progress,
) -> None:
    """The decoding loop of `generate_replies`: appends each row's new tokens (eos left out) to `replies`."""
    import torch

    from zerofit.loop.rollout import decode_step

    live, cache, step_ids, base = list(range(len(replies))), None, ids, progress.done
    for step in range(1, max_new_tokens + 1):
        logits, cache = decode_step(model, step_ids, mask, cache, logits_to_keep=1)
        tokens = logits.float().argmax(dim=-1).tolist()
        keep = []
        for k, (row, token) in enumerate(zip(live, tokens, strict=True)):
            if token == tokenizer.eos_token_id:
                continue
            replies[row].append(token)
            if not rules[row](tokenizer.decode(replies[row], skip_special_tokens=True)):
                keep.append(k)
        live = [live[k] for k in keep]
        progress.update(base + len(replies) - len(live) * (1 - min(1.0, step / max_new_tokens)))
        if not live:
            return
        index = torch.tensor(keep)
        cache.batch_select_indices(index)
        mask = torch.cat([mask[index], mask.new_ones(len(keep), 1)], dim=1)
        step_ids = torch.tensor([[tokens[k]] for k in keep], dtype=ids.dtype)


def _score_model(
    model: Any, tokenizer: Any, sets: list[tuple[list[Probe], Check]], progress: Progress
) -> list[list[str]]:
    """One model's replies to every probe of `sets`, generated together; the first `SAMPLES` task probes
    (shown in the report) are generated whole, every other reply until its verdict is settled."""
    prompts = [p.prompt for probes, _ in sets for p in probes]
    rules: list[Callable[[str], bool] | None] = []
    for k, (probes, check) in enumerate(sets):
        rules += [
            None if k == 0 and i < SAMPLES else functools.partial(_settled_by, check, probe)
            for i, probe in enumerate(probes)
        ]
    replies = generate_replies(model, tokenizer, prompts, settled=rules, progress=progress)
    out, start = [], 0
    for probes, _ in sets:
        out.append(replies[start : start + len(probes)])
        start += len(probes)
    return out


def _settled_by(check: Check, probe: Probe, reply: str) -> bool:
    return check.settled(reply, probe)


def _score_sets(
    named: list[tuple[str, list[Probe], Check]], trained: Any, progress: Progress
) -> list[SetScore]:
    """Both models' replies to every set of `named` (the base: the adapters disabled) and the verdicts."""
    model, tokenizer = trained.model, trained.tokenizer
    sets = [(probes, check) for _, probes, check in named]
    progress.update(status="the base model")
    with _base_model(trained) as base:
        before = _score_model(base, tokenizer, sets, progress)
    progress.update(status="the trained adapter")
    after = _score_model(model, tokenizer, sets, progress)
    return [
        _verdicts(name, probes, check.passes, b, a)
        for (name, probes, check), b, a in zip(named, before, after, strict=True)
    ]


def _verdicts(
    name: str, probes: list[Probe], passes: Callable[[str, Probe], bool], before: list[str], after: list[str]
) -> SetScore:
    """A probe set's replies before and after, with `passes(reply, probe)`'s verdict on each."""
    return SetScore(
        name,
        probes,
        before,
        after,
        [passes(reply, probe) for reply, probe in zip(before, probes, strict=True)],
        [passes(reply, probe) for reply, probe in zip(after, probes, strict=True)],
    )


def score_run(
    run_dir: Path, task: Path, facts: Path, before: Callable[[], None] | None = None
) -> tuple[SetScore, SetScore]:
    """The task and facts scores of the run in `run_dir` (its final adapter) against its base model, with
    the progress of the whole of it (`before`, run first inside it: the command's own slow imports)."""
    task_probes, fact_probes = read_probes(task), read_probes(facts)
    n = len(task_probes) + len(fact_probes)
    with progress(f"scoring {n} held-out prompts, base model and trained adapter", 2 * n, "replies") as state:
        if before is not None:
            state.update(status="importing torch and transformers")
            before()
        state.update(status=f"loading {run_dir}")
        from zerofit.trained import load_trained

        trained = load_trained(run_dir)
        if not trained.is_lora:
            raise ConfigError(
                [f"{run_dir}: lora.enabled=false; the demo's scorer compares a LoRA run with its base"]
            )
        trained.model.eval()
        task_score, facts_score = _score_sets(
            [("task", task_probes, TASK_CHECK), ("facts", fact_probes, FACTS_CHECK)], trained, state
        )
    return task_score, facts_score


@contextlib.contextmanager
def _base_model(trained: Any) -> Iterator[Any]:
    """The model the run started from: a LoRA run's model with its adapters disabled, or a full fine-tuning
    run's base weights loaded again."""
    if trained.is_lora:
        with trained.model.disable_adapter():
            yield trained.model
        return
    import torch

    from zerofit.trained.model import load_base

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
    return _verdicts(name, probes, check, before, replies(trained.model))


def _loaded(run_dir: Path) -> Any:
    """The run's trained model (`trained.load_trained`), in eval mode."""
    from zerofit.trained import load_trained

    trained = load_trained(run_dir)
    trained.model.eval()
    return trained


def score_images(run_dir: Path, images: Path) -> SetScore:
    """The image task's score of the vision-language run in `run_dir` against its base model: each probe's
    image and prompt as one user turn (`zerofit generate --image`'s `Generator`), answered greedily."""
    import torch

    from zerofit.models.build import resolve_model_path
    from zerofit.trained.generate import Generator

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


def _report(args: argparse.Namespace, imports: Callable[[], None]) -> str:
    """The report the arguments ask for: the image task, or the task and the facts (`imports`: the
    command's own slow imports, run first)."""
    if args.images is not None:
        imports()
        return format_images_report(score_images(args.run_dir, args.images))
    return format_report(*score_run(args.run_dir, args.task, args.facts, imports))


def main(argv: Sequence[str] | None = None) -> int:
    """Score a run and print the report; a user error is one paragraph (exit 2)."""
    from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries

    parser = argparse.ArgumentParser(
        prog="python -m zerofit.demo.score", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="a finished run's folder")
    parser.add_argument("--task", type=Path, help="held-out task probes (JSON Lines), with --facts")
    parser.add_argument("--facts", type=Path, help="held-out fact probes (JSON Lines), with --task")
    parser.add_argument("--images", type=Path, help=f"held-out image probes (JSON Lines of {IMAGE_PROBE})")
    args = parser.parse_args(argv)

    def imports() -> None:
        # Before torch loads OpenMP: its 2 threads otherwise spin at every op waiting for each other, and on
        # a busy 2-core machine (`make demo` beside other work) a generation step then took 13-17 s wall
        # instead of 0.7 (measured, 16 prompts). Waiting threads sleep instead; a user's own setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        quiet_deepspeed_on_cpu()
        quiet_libraries()

    text = args.task is not None or args.facts is not None
    if (args.images is not None) == text or (text and (args.task is None or args.facts is None)):
        parser.error("give --task and --facts (a language model's run), or --images (a vision-language run)")
    try:
        print(_report(args, imports), flush=True)
    except ZerofitError as exc:
        print(f"zerofit: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
