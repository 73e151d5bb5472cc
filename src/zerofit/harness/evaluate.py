"""One lm-eval evaluation of a model zerofit holds in memory, through lm-eval's Python API.

`load_tasks` resolves the task names first (zerofit's shipped tasks as configs over their local files,
`zerofit.harness.shipped`; any other name from lm-eval's own registry), builds each task once so its data is
fetched (or found in the datasets cache) before any model loads, and turns a task whose data cannot be had
(no network, `HF_HUB_OFFLINE`/`HF_DATASETS_OFFLINE`, not cached) into one paragraph. `evaluate` wraps the
model object in lm-eval's `HFLM` (no merge, no copy: a peft model evaluates with its adapters as they are,
and with `disable_adapter()` as its base) and runs `lm_eval.simple_evaluate`, greedy, in eval mode without
gradients; `scores` reads lm-eval's results as `{task: {metric: value}}`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zerofit.core.errors import ConfigError, DataError
from zerofit.harness.shipped import shipped_names, task_config

__all__ = ["HarnessSettings", "LoadedTasks", "evaluate", "load_tasks", "replies", "scores"]

# lm-eval's results keys are `<metric>,<filter>`; `none` is the unfiltered one.
_NO_FILTER = "none"
_STDERR = "_stderr"


@dataclass(frozen=True)
class HarnessSettings:
    """What to evaluate and how: task names, at most `limit` documents per task (a fraction < 1: that share),
    `num_fewshot` examples (None: each task's own), `batch_size` requests per forward (or lm-eval's `auto`),
    and whether prompts go through the tokenizer's chat template."""

    tasks: tuple[str, ...]
    limit: float | None = None
    num_fewshot: int | None = None
    batch_size: int | str = 8
    apply_chat_template: bool = False


@dataclass
class LoadedTasks:
    """The tasks as lm-eval takes them (a shipped task's config, any other task's name) and the task manager
    that resolves them (lm-eval's own registry only when a name needs it: indexing it takes seconds)."""

    specs: list[Any]
    manager: Any


def _quiet_lm_eval() -> None:
    """lm-eval's info lines and per-task progress bars are for its own CLI; errors still show."""
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets

    datasets.disable_progress_bars()


def _hub_problem(name: str, exc: BaseException) -> DataError:
    return DataError(
        f"lm-eval task {name!r}: its data cannot be fetched ({type(exc).__name__}: {str(exc).splitlines()[0]}): "
        "the Hugging Face Hub is out of reach (no network, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set) and the "
        "dataset is not in the datasets cache. Run once where the Hub can be reached (the data is cached for "
        f"later offline runs), or evaluate with a task zerofit ships, which reads local files: "
        f"{', '.join(shipped_names())}"
    )


def load_tasks(names: tuple[str, ...]) -> LoadedTasks:
    """The tasks `names` resolved and built once (their data fetched or found cached); see the module doc."""
    from lm_eval.tasks import TaskManager

    _quiet_lm_eval()
    shipped = set(shipped_names())
    hub = [name for name in names if name not in shipped]
    manager = TaskManager(include_defaults=bool(hub))
    unknown = [name for name in hub if not manager.match_tasks([name])]
    if unknown:
        raise ConfigError(
            [
                f"--tasks {','.join(unknown)}: no such lm-eval task; zerofit ships {', '.join(sorted(shipped))} "
                "(offline), and `lm_eval ls tasks` lists lm-eval's own (gsm8k, mmlu, hellaswag, ifeval, ...)"
            ]
        )
    specs = [task_config(name) if name in shipped else name for name in names]
    for name, spec in zip(names, specs, strict=True):
        if name in shipped:
            continue
        try:
            manager.load([spec])
        except OSError as exc:  # ConnectionError, a dataset not cached offline (FileNotFoundError)
            raise _hub_problem(name, exc) from None
    return LoadedTasks(specs, manager)


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """`model` in eval mode without gradients for the evaluation, then back in the mode it was in."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def evaluate(model: Any, tokenizer: Any, tasks: LoadedTasks, settings: HarnessSettings) -> dict[str, Any]:
    """lm-eval's results dict for `model` (in memory, as it is) on `tasks`."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    _quiet_lm_eval()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    with _eval_mode(model):
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks.specs),
            task_manager=tasks.manager,
            limit=settings.limit,
            num_fewshot=settings.num_fewshot,
            apply_chat_template=settings.apply_chat_template,
            log_samples=True,  # the replies go to the results file (`replies`): what was scored, readable
            bootstrap_iters=0,  # no bootstrap stderr: seconds per metric on a CPU, and not reported
        )
    return dict(results or {})


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """`{task: {metric: value}}` of lm-eval's results (groups included): numeric metrics only, no stderr,
    a filtered metric named `<metric>_<filter>` (gsm8k's `exact_match_strict-match`)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            metric, _, filt = str(key).partition(",")
            if not filt or metric.endswith(_STDERR) or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                name = metric if filt == _NO_FILTER else f"{metric}_{filt}"
                out.setdefault(task, {})[name] = float(value)
    return out


def replies(results: dict[str, Any]) -> dict[str, list[Any]]:
    """`{task: [the model's answer to each document, in document order]}` of lm-eval's logged samples (a
    generated reply's text; a loglikelihood task's filtered response)."""
    out: dict[str, list[Any]] = {}
    for task, samples in (results.get("samples") or {}).items():
        ordered = sorted(samples, key=lambda sample: sample.get("doc_id", 0))
        out[task] = [_first(sample.get("filtered_resps")) for sample in ordered]
    return out


def _first(value: Any) -> Any:
    """The response itself out of lm-eval's per-sample list (one entry for a generated reply)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value
