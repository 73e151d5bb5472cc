"""`zerofit eval TARGET --tasks T1,T2`: lm-eval benchmark scores of a run, an export or a model.

TARGET is what `zerofit generate` takes: a run directory (its newest weights, or `--step N|best`; any engine's
checkpoint or the final export, adapters applied as they trained, never merged), a `zerofit export` folder,
or a model as `model.name_or_path` takes it (a built-in name, a hub id, a local folder). The model is handed to
EleutherAI's lm-eval as an object (`HFLM(pretrained=model)`), so what is scored is what zerofit loaded. A LoRA
target is scored twice, its base first (the adapters disabled) and then trained. Tasks: the offline ones
zerofit ships (zerofit_demo_format, zerofit_demo_capitals, zerofit_demo_sums; local files, no network) and any
lm-eval task (gsm8k, mmlu, hellaswag, ifeval, ...: their data from the Hub or its cache). For a run directory
the results go to RUN/eval/harness-step-N.json, a row of metrics.jsonl (harness/<task>/<metric>), the W&B run's
summary and `zerofit compare`'s table. Needs the `eval` extra: pip install 'zerofit[eval]'.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerofit.commands.export import add_step_flag, add_trust_flags
from zerofit.core.errors import ConfigError
from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries

# The `eval` extra's install command, said when lm-eval is missing.
INSTALL = "pip install 'zerofit[eval]'"


def register(subparsers: Any) -> None:
    """Add the `eval` subcommand."""
    parser = subparsers.add_parser(
        "eval",
        help="lm-eval benchmark scores of a run (base and trained), an export or a model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="RUN_DIR|EXPORT_DIR|MODEL", help="what to evaluate (see above)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--limit", type=float, default=None, metavar="N", help="at most N documents per task")
    parser.add_argument(
        "--num-fewshot", type=int, default=None, metavar="K", help="few-shot examples per prompt"
    )
    parser.add_argument(
        "--batch-size", default="8", metavar="B", help="requests per forward, or auto (default 8)"
    )
    parser.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prompts as a user turn of the tokenizer's chat template (default: as the run trained, on for a run "
        "on chat messages; for a model or export from elsewhere, on when its tokenizer has a template)",
    )
    parser.add_argument("--no-base", action="store_true", help="score only the trained model, not its base")
    add_step_flag(parser)
    add_trust_flags(parser)
    parser.set_defaults(func=run)


def _settings(args: argparse.Namespace, chat: bool) -> Any:  # HarnessSettings (lm-eval-free import)
    """The harness settings of the flags, each checked (one paragraph per bad value)."""
    from zerofit.harness.evaluate import HarnessSettings

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    problems = [] if tasks else [f"--tasks {args.tasks!r}: name at least one task (comma-separated)"]
    if args.limit is not None and args.limit <= 0:
        problems.append(f"--limit {args.limit:g}: must be > 0 (a count, or a fraction below 1)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        problems.append(f"--num-fewshot {args.num_fewshot}: must be >= 0")
    batch = args.batch_size
    if batch != "auto" and not (batch.isdigit() and int(batch) >= 1):
        problems.append(f"--batch-size {batch!r}: must be a whole number >= 1, or auto")
    if problems:
        raise ConfigError(problems)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    return HarnessSettings(tasks, limit, args.num_fewshot, batch if batch == "auto" else int(batch), chat)


def _require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            [f"zerofit eval runs EleutherAI's lm-eval, which is not installed; install it with {INSTALL}"]
        )


@contextlib.contextmanager
def _base_of(model: Any) -> Iterator[Any]:
    """The base of a LoRA model (its adapters disabled), else None: a full model has no base in memory."""
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
    else:
        yield None


def run(args: argparse.Namespace) -> int:
    """Resolve the tasks, load the target, score it (base and trained), print and record the scores."""
    _require_lm_eval()
    asked = _settings(args, False)  # flags checked before anything loads
    # Before torch loads OpenMP: spinning waiting threads slowed each generation step ~20x on a busy 2-core
    # machine (as `zerofit.demo.score` measured); waiting threads sleep instead. A user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    quiet_deepspeed_on_cpu()
    quiet_libraries()
    from zerofit.checkpoint.policy import resolve_step
    from zerofit.harness.evaluate import evaluate, load_tasks, scores
    from zerofit.trained.generate import load_generator

    tasks = load_tasks(asked.tasks)  # data fetched, or refused, before a model loads
    step = resolve_step(Path(args.path), args.step) if args.step is not None else None
    generator = load_generator(
        args.path, step=step, trust_pickles=args.trust_pickles, trust_remote_code=args.trust_remote_code
    )
    chat = generator.chat if args.apply_chat_template is None else args.apply_chat_template
    settings = dataclasses.replace(asked, apply_chat_template=chat)
    model, tokenizer = generator.model, generator.tokenizer
    results: dict[str, Any] = {}
    if not args.no_base:
        with _base_of(model) as base:
            if base is not None:
                results["base"] = evaluate(base, tokenizer, tasks, settings)
    results["trained"] = evaluate(model, tokenizer, tasks, settings)
    table = {label: scores(found) for label, found in results.items()}
    sys.stdout.write(format_scores(table, settings) + "\n")
    _record(Path(args.path), step, settings, results, table)
    sys.stdout.flush()
    return 0


def format_scores(table: dict[str, dict[str, dict[str, float]]], settings: Any) -> str:
    """The scores as a text table: one line per task and metric, a column per model (base, trained)."""
    labels = list(table)
    pairs = sorted(
        {(task, metric) for found in table.values() for task, ms in found.items() for metric in ms}
    )
    width = max([len(task) for task, _ in pairs] + [4])
    lines = [f"{'task':<{width}}  {'metric':<10}" + "".join(f"{label:>10}" for label in labels)]
    for task, metric in pairs:
        cells = "".join(_cell(table[label].get(task, {}).get(metric)) for label in labels)
        lines.append(f"{task:<{width}}  {metric:<10}{cells}")
    chat = "on" if settings.apply_chat_template else "off"
    shots = "each task's own" if settings.num_fewshot is None else str(settings.num_fewshot)
    limit = "all documents" if settings.limit is None else f"limit {settings.limit:g}"
    lines.append(f"(lm-eval; chat template {chat}, few-shot {shots}, {limit})")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value:>10.4f}"


def _record(
    target: Path,
    step: int | None,
    settings: Any,
    results: dict[str, Any],
    table: dict[str, dict[str, dict[str, float]]],
) -> None:
    """For a run directory: the results file, a post-hoc metrics row and the W&B summary (said on stdout)."""
    from zerofit.config.loader import read_config_file
    from zerofit.core.run_layout import CONFIG_FILE
    from zerofit.harness.evaluate import replies
    from zerofit.harness.results import append_posthoc_row, score_fields, update_wandb_summary, write_results
    from zerofit.trained.checkpoints import find_weights

    if not (target / CONFIG_FILE).is_file():
        return
    source = find_weights(target, step)
    report = {
        "step": source.step,
        "weights": source.describe(),
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__},
        "scores": table,
        "replies": {label: replies(found) for label, found in results.items()},
        "lm_eval": {
            label: {k: found.get(k) for k in ("results", "versions", "n-samples", "configs")}
            for label, found in results.items()
        },
    }
    path = write_results(target, source.step, report)
    fields = score_fields(table["trained"])
    where = [str(path)]
    if source.step is not None and fields:
        where.append(f"{append_posthoc_row(target, source.step, fields)} (step {source.step})")
        if update_wandb_summary(
            target, read_config_file(target / CONFIG_FILE), {**fields, "harness/step": source.step}
        ):
            where.append("the W&B run's summary")
    sys.stdout.write(f"results: {', '.join(where)}\n")
