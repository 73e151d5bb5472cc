"""What the zerofit-vs-HF benchmarks feed both trainers, and how zerofit is run on it in-process.

Two workloads of the same examples for both trainers (token ids are random: speed and memory do not
depend on them):

- `max_length`: every example is `seq` tokens, all of them labels (as the GPU runs of 2026-12-01);
- `real_length`: lengths drawn from a log-normal (median 30% of `seq`, sigma 0.7: a long tail of long
  examples, as SFT data tends to have), clipped to [16, seq], with the first 20-60% of every example a
  masked prompt. Padding to a micro-batch's longest example wastes much of the compute here; packing
  (`batch.tokens_per_micro_batch`) does not.

`run_zerofit` trains a resolved config on such examples exactly as the launcher's loop does
(`zerofit.recipe.assembly.assemble` + `zerofit.loop.train.train_loop`), and returns the steady-state throughput of the
fields the loop writes to metrics.jsonl, plus the process CPU time per step (on a CPU shared with other
work, CPU time measures the work done where wall time measures the neighbours too).

The real-model benchmarks that train then score (`grpo_real.py`, `agent_real.py`) share their driver here:
`add_run_arguments` (their command line), `train_then_score` (train through `zerofit.train`, score the base
and the trained model the same way) and `run_benchmark` (threads, run folder, results file).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerofit.data import Example
    from zerofit.resolution import ResolvedConfig

IGNORE_INDEX = -100


def report_header(
    script: str, argv: Sequence[str] | None, load_at_start: list[float], **machine: Any
) -> dict:
    """The opening fields of a benchmark's results file: the script, the command line that ran it, the UTC
    time and the machine (CPU, cores, torch, then `machine`'s own fields such as threads, and the load average
    when it started: a shared CPU says how loaded it was)."""
    import torch

    line = " ".join(argv if argv is not None else sys.argv[1:])
    return {
        "script": f"benchmarks/{script}",
        "command": f"python benchmarks/{script} {line}".rstrip(),
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            **machine,
            "load_average_at_start": load_at_start,
        },
    }


def max_length_examples(n: int, seq: int, vocab: int, seed: int = 0) -> list[Example]:
    """`n` examples of exactly `seq` tokens, every token a label."""
    from zerofit.data import Example

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(seq)]
        out.append(Example(ids, list(ids)))
    return out


def real_length_examples(n: int, seq: int, vocab: int, seed: int = 0) -> list[Example]:
    """`n` examples with log-normal lengths (median 0.3 x seq, sigma 0.7, clipped to [16, seq]) and a masked
    prompt of 20-60% of each."""
    from zerofit.data import Example

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(seq, max(16, round(rng.lognormvariate(math.log(0.3 * seq), 0.7)))))
        ids = [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]
        prompt = max(1, int(length * rng.uniform(0.2, 0.6)))
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def workload(name: str, n: int, seq: int, vocab: int, seed: int = 0) -> list[Example]:
    """`max_length` or `real_length` examples."""
    if name == "max_length":
        return max_length_examples(n, seq, vocab, seed)
    if name == "real_length":
        return real_length_examples(n, seq, vocab, seed)
    raise ValueError(f"unknown workload {name!r}: max_length or real_length")


def describe(examples: list[Example]) -> dict[str, float]:
    """Length statistics of a workload (for the results file)."""
    lengths = [len(e.input_ids) for e in examples]
    return {
        "examples": len(lengths),
        "mean_tokens": round(statistics.fmean(lengths), 1),
        "median_tokens": statistics.median(lengths),
        "max_tokens": max(lengths),
        "label_tokens_per_example": round(
            statistics.fmean(sum(lab != IGNORE_INDEX for lab in e.labels[1:]) for e in examples), 1
        ),
    }


def _rows_sink() -> Any:
    """A metrics sink that keeps the rows (what metrics.jsonl would get): `.rows`."""
    from zerofit.metrics.base import MetricsSink

    class Rows(MetricsSink):
        # Subclassing the loop's protocol (not copying it) means a method the protocol gains is inherited
        # (as a no-op) instead of failing here at run time.
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def log(self, step: int, metrics: dict[str, Any]) -> None:
            self.rows.append({"step": step, **metrics})

    return Rows()


def _step_hook(callback: Callable[[int], None]) -> Any:
    """Stands in for the checkpointer: calls `callback(steps_done)` after every step, saves nothing."""
    from zerofit.loop.train import CheckpointSaver

    class StepHook(CheckpointSaver):
        # The loop's own protocol as the base, and every argument the loop passes after `steps_done`
        # accepted (the loop added `stopping` once, and this hook broke with a TypeError).
        def after_step(self, steps_done: int, *args: Any, **kwargs: Any) -> None:
            del args, kwargs
            callback(steps_done)

    return StepHook()


def rank_peaks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's peak over the steady-state steps, from the `mem/rank{r}/...` fields the loop logs.

    The loop resets the CUDA peak counters at every logged step (`zerofit.metrics.memory`), so after a run
    `torch.cuda.max_memory_allocated()` covers only what came after the last log; the logged per-step peaks
    are the steps' own. On CUDA `peak_gib` is the allocated peak and `peak_reserved_gib` the reserved one; on
    CPU (`mem/source` = cpu_rss) both are the process RSS, which says nothing about a GPU.
    """
    out: list[dict[str, Any]] = []
    rank = 0
    while rows and f"mem/rank{rank}/peak_gib" in rows[0]:
        peak = max(float(r[f"mem/rank{rank}/peak_gib"]) for r in rows)
        reserved = [
            float(r[f"mem/rank{rank}/peak_reserved_gib"])
            for r in rows
            if f"mem/rank{rank}/peak_reserved_gib" in r
        ]
        out.append(
            {
                "rank": rank,
                "peak_gib": round(peak, 3),
                "peak_reserved_gib": round(max(reserved), 3) if reserved else None,
                "source": rows[0].get("mem/source"),
            }
        )
        rank += 1
    return out


def run_zerofit(
    resolved: ResolvedConfig,
    examples: list[Example],
    steps: int,
    after_step: Callable[[int], None] | None = None,
    evaluate: Callable[[Any, Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train `steps` + 1 optimizer steps of `resolved` on `examples` (the first is warm-up: it creates the
    optimizer state); returns the steady-state means of the logged throughput fields and the losses.
    `after_step(steps_done)` runs after every step (the GPU benchmark resets its memory peaks there).
    `evaluate(model, tokenizer)`, when given, runs on the trained (peft) model before it is released; its
    dict is the result's `evaluation` (the quality benchmark)."""
    from zerofit.data import GlobalBatchSampler
    from zerofit.loop.train import LoopInputs, train_loop
    from zerofit.recipe.assembly import assemble

    cfg = resolved.config
    cpu_marks: list[float] = []  # process CPU time after every step: steadier than wall time on a shared CPU

    def mark(done: int) -> None:
        cpu_marks.append(time.process_time())
        if after_step is not None:
            after_step(done)

    run = assemble(resolved, with_data=False)
    try:
        sink = _rows_sink()
        loop = LoopInputs(
            strategy=run.strategy,
            model=run.model,
            examples=examples,
            sampler=GlobalBatchSampler(
                len(examples), resolved.batch.global_batch_size, cfg.seed, cfg.data.shuffle
            ),
            batch=run.plan.batch,
            max_steps=steps + 1,
            max_grad_norm=cfg.train.max_grad_norm,
            pad_id=int(run.built.tokenizer.pad_token_id),
            sink=sink,
            checkpointer=_step_hook(mark),
            flops_per_token=run.flops_per_token,
            precision=cfg.train.precision,
            cross_entropy=cfg.train.cross_entropy,
            packed_row_tokens=cfg.data.max_seq_len if cfg.batch.tokens_per_micro_batch is not None else None,
            compiled=run.built.compiled_layers > 0,
            objective=run.objective,  # train.objective's loss (SFT's token sums, DPO's pairs, ...)
        )
        results = train_loop(loop)
        evaluation = evaluate(run.built.model, run.built.tokenizer) if evaluate is not None else None
    finally:
        run.close()
    steady = sink.rows[1:] or sink.rows
    seconds = sum(r["step_time_s"] for r in steady)
    cpu_seconds = cpu_marks[-1] - cpu_marks[0] if len(cpu_marks) > 1 else float("nan")

    def count(field: str) -> float:
        return sum(r[field] * r["step_time_s"] for r in steady)

    return {
        "step_time_s": round(seconds / len(steady), 4),
        "tokens_per_s": round(count("tokens_per_s") / seconds, 1),
        "useful_tokens_per_s": round(count("useful_tokens_per_s") / seconds, 1),
        "processed_tokens_per_s": round(count("processed_tokens_per_s") / seconds, 1),
        "cpu_s_per_step": round(cpu_seconds / len(steady), 4),
        "useful_tokens_per_cpu_s": round(count("useful_tokens_per_s") / cpu_seconds, 1),
        "losses": [round(r.loss, 5) for r in results],
        "evaluation": evaluation,
        "memory_per_rank": rank_peaks(steady),
        # train.compile: dynamo's graph breaks over the run (the first, warm-up step compiles; new shapes of
        # the real-length workload recompile there and later, inside the measured steps).
        "compile_graph_breaks": sink.rows[-1].get("compile/graph_breaks") if sink.rows else None,
        "split": {
            "micro_batch_size": resolved.batch.micro_batch_size,
            "grad_accum_steps": resolved.batch.grad_accum_steps,
            "tokens_per_micro_batch": cfg.batch.tokens_per_micro_batch,
            "activation_checkpointing": cfg.train.activation_checkpointing,
            "cross_entropy": cfg.train.cross_entropy,
        },
    }


def add_run_arguments(parser: argparse.ArgumentParser, samples: int, smoke: str) -> None:
    """The command line the train-then-score benchmarks share (`grpo_real.py`, `agent_real.py`): held-out
    samples and seed, CPU threads, the smoke check, the results file, the run folder, config overrides."""
    parser.add_argument(
        "--samples", type=int, default=samples, help="sampled completions per held-out prompt"
    )
    parser.add_argument("--seed", type=int, default=1234, help="the held-out decode's sampling seed")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help=smoke)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--runs", type=Path, default=None, help="where the run folder goes (default: a temp)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")


def train_then_score(cfg: Any, score: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any]:
    """Train `cfg` through zerofit's own API (`zerofit.train`: the launcher's run, one process), then
    `score(model, tokenizer)` the base and the trained model. The base is the trained model with its LoRA
    adapters switched off (the reference GRPO uses), or, for a full fine-tune, the starting weights loaded
    again. Returns the training wall time, both scores and the run's metrics rows."""
    import torch

    import zerofit
    from zerofit.trained.model import load_base, load_trained

    started = time.perf_counter()
    result = zerofit.train(cfg)
    train_s = time.perf_counter() - started
    trained = load_trained(result.run_dir)
    model, tokenizer = trained.model, trained.tokenizer
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            base = score(model, tokenizer)
    else:
        base = score(load_base(cfg, torch.float32, "cpu").eval(), tokenizer)
    after = score(model, tokenizer)
    return {"train_s": train_s, "base": base, "trained": after, "metrics": result.metrics}


def run_benchmark(
    script: str,
    argv: Sequence[str] | None,
    args: argparse.Namespace,
    work: Callable[[Path], dict[str, Any]],
    report: Callable[[dict[str, Any]], dict[str, Any]],
    show: Callable[[dict[str, Any]], None],
) -> int:
    """A train-then-score benchmark's main: `args.threads` torch threads, quiet libraries, `work(runs)` in
    `args.runs` (or a temporary folder), then the results (`report_header` + `report(out)`) printed by
    `show` and written to `args.json`."""
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from zerofit.core.messages import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or Path(tmp)
        runs.mkdir(parents=True, exist_ok=True)
        out = work(runs)
    results = {**report_header(script, argv, load_at_start, threads=args.threads), **report(out)}
    show(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
