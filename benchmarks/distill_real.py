"""On-policy distillation on the real pretrained model: a student SmolLM2-135M-Instruct + LoRA, with no
labels, learns the demo's JSON answer format from a teacher; the held-out format score before and after, on CPU.

    1. The teacher is the demo's run (`configs/demo-smollm2.yaml`: SmolLM2 + LoRA learns to answer as one JSON
       object {"answer": "..."} from 67 short chats), trained here by `zerofit.train` on one process in fp32
       (the demo's 24 steps, its learning rate and LoRA), then exported merged by `zerofit export --merge`:
       the teacher is that export folder (`gkd.teacher`), a plain model folder.
    2. The student is the base `smollm2-135m-instruct` + LoRA (the demo's r 8), `train.objective: gkd` with
       `gkd.lmbda: 1` (every completion is the student's own sample: no completion column, no labels) and
       `gkd.beta: 1` (the reverse KL of on-policy distillation, Agarwal et al. 2024, Qwen3's and Thinking
       Machines'), on the demo's own 67 questions as prompts only (their answers are dropped).
    3. Both runs are scored by the demo's scorer (`zerofit.demo.score.score_run`: greedy replies, the base =
       the run with its adapters off) on the demo's held-out prompts: 20 new questions, a reply passing when
       it is exactly one JSON object {"answer": ...} (the format), and 16 capitals the base knows (facts).

    python benchmarks/distill_real.py                          # ~6 min on 2 shared cores
    python benchmarks/distill_real.py --json benchmarks/results/distill_real-smollm2-<date>.json
    python benchmarks/distill_real.py optimizer.lr=1e-3         # overrides of the student's run
    python benchmarks/distill_real.py --smoke                  # tiny-llama, 1 step each: checks the script
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo-smollm2.yaml"
TASK, FACTS = REPO / "data" / "demo_smollm2_heldout.jsonl", REPO / "data" / "demo_smollm2_facts.jsonl"
ONE_PROCESS = (
    "distributed.strategy=single",
    "distributed.preset=null",
    "train.precision=fp32",
    "logging.wandb.mode=disabled",
    "logging.console=false",
    "checkpoint.every_minutes=0",
)
# The student: the demo's model and LoRA, prompts only, its own samples, the reverse KL to the teacher.
STUDENT = (
    "train.objective=gkd",
    "train.max_steps=30",
    "optimizer.lr=5.0e-4",
    "scheduler.warmup_steps=3",
    "batch.global_batch_size=null",
    "batch.micro_batch_size=8",
    "rl.num_generations=2",
    "rl.prompts_per_step=4",
    "rl.max_prompt_length=64",
    "rl.max_completion_length=32",
    "rl.temperature=0.9",
    "rl.log_completions_every=5",
    "gkd.lmbda=1",
    "gkd.beta=1",
)
SMOKE = ("model.name_or_path=tiny-llama", "train.max_steps=1")


def prompts_only(source: Path, out: Path) -> Path:
    """The demo's chats as prompts alone: each record's user turns, its answer dropped (no labels)."""
    rows = []
    for line in source.read_text().splitlines():
        messages = json.loads(line)["messages"]
        rows.append({"prompt": [m for m in messages if m["role"] == "user"]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _probes(source: Path, out: Path, smoke: bool) -> Path:
    """The held-out probe file (its first 3 lines with --smoke)."""
    lines = source.read_text().splitlines()
    out.write_text("\n".join(lines[:3] if smoke else lines) + "\n")
    return out


def _score(run_dir: Path, task: Path, facts: Path) -> dict[str, Any]:
    """The demo's scorer on a run: format and facts passes of the base and of the run's model."""
    from zerofit.demo.score import score_run

    task_score, facts_score = score_run(run_dir, task, facts)
    (fmt_base, fmt_after), (facts_base, facts_after) = task_score.counts, facts_score.counts
    return {
        "format": {"base": fmt_base, "after": fmt_after, "of": len(task_score.probes)},
        "facts": {"base": facts_base, "after": facts_after, "of": len(facts_score.probes)},
        "samples_after": task_score.after[:3],
        "samples_base": task_score.before[:3],
    }


def train_teacher(runs: Path, smoke: bool) -> tuple[Path, Path, float]:
    """The demo's run on one process, exported merged: (run folder, export folder, seconds)."""
    import zerofit

    started = time.perf_counter()
    extra = [*ONE_PROCESS, *(SMOKE if smoke else ())]
    result = zerofit.train(str(DEMO), output_dir=str(runs), run_name="teacher", **_as_kwargs(extra))
    export = runs / "teacher-merged"
    zerofit_bin = Path(sys.executable).parent / "zerofit"
    subprocess.run(
        [str(zerofit_bin), "export", str(result.run_dir), "--merge", "--out", str(export)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return result.run_dir, export, time.perf_counter() - started


def _as_kwargs(items: list[str]) -> dict[str, Any]:
    """`key=value` overrides as `zerofit.train`'s keyword overrides (dotted keys, values as YAML reads them)."""
    import yaml

    return {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in items)}


def train_student(runs: Path, teacher: Path, prompts: Path, args: argparse.Namespace) -> tuple[Any, float]:
    """The student's gkd run (the demo's model and LoRA) against `teacher`: its result and seconds."""
    import zerofit

    started = time.perf_counter()
    extra = [*ONE_PROCESS, *STUDENT, *(SMOKE if args.smoke else ()), *args.overrides]
    extra += [f"gkd.teacher={teacher}", f"data.path={prompts}", "data.format=auto"]
    result = zerofit.train(str(DEMO), output_dir=str(runs), run_name="student", **_as_kwargs(extra))
    return result, time.perf_counter() - started


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, 1 step each, 3 probes per set")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--runs", type=Path, default=None, help="where the run folders go (default: a temp)")
    parser.add_argument("overrides", nargs="*", help="overrides of the student's run, key=value")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """Teacher, student, and the scores of both against the base."""
    task, facts = (
        _probes(TASK, runs / "task.jsonl", args.smoke),
        _probes(FACTS, runs / "facts.jsonl", args.smoke),
    )
    teacher_run, teacher, teacher_s = train_teacher(runs, args.smoke)
    prompts = prompts_only(REPO / "data" / "demo_smollm2.jsonl", runs / "prompts.jsonl")
    student, student_s = train_student(runs, teacher, prompts, args)
    curve = [(r["step"], round(r["loss"], 4)) for r in student.metrics if "loss" in r]
    return {
        "teacher": {"train_wall_s": round(teacher_s, 1), **_score(teacher_run, task, facts)},
        "student": {
            "train_wall_s": round(student_s, 1),
            "loss_per_step": curve,
            **_score(student.run_dir, task, facts),
        },
    }


def _one_thread_pool(threads: int) -> None:
    """torch's CPU threads (and OpenMP's) to `threads`, the libraries' chatter off."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    from zerofit.core.messages import quiet_libraries

    torch.set_num_threads(threads)
    quiet_libraries()


def main(argv: list[str] | None = None) -> int:
    from plan_speed import machine  # the same record of where it ran as the plan benchmark's

    args = parse(argv)
    where = {
        **machine(),
        "threads": args.threads,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    _one_thread_pool(args.threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or Path(tmp)
        runs.mkdir(parents=True, exist_ok=True)
        measured = measure(args, runs)
    report = {
        "script": "benchmarks/distill_real.py",
        "command": "python benchmarks/distill_real.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": where,
        "teacher_run": {"config": "configs/demo-smollm2.yaml", "overrides": list(ONE_PROCESS)},
        "student_run": {
            "config": "configs/demo-smollm2.yaml",
            "overrides": [*ONE_PROCESS, *STUDENT, *args.overrides],
        },
        "model": "tiny-llama" if args.smoke else "smollm2-135m-instruct",
        **measured,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, args.json)
    return 0


def print_report(report: dict[str, Any], written: Path | None) -> None:
    """The held-out format and facts of the base, the teacher and the distilled student (and where the
    report was `written`)."""
    t, s = report["teacher"], report["student"]
    fmt, facts = s["format"], s["facts"]
    print(f"{report['model']}: held-out format (one JSON object) and facts, greedy")
    print(f"  base      format {fmt['base']}/{fmt['of']}  facts {facts['base']}/{facts['of']}")
    print(f"  teacher   format {t['format']['after']}/{fmt['of']}  facts {t['facts']['after']}/{facts['of']}  "
          f"(the demo's SFT run, {t['train_wall_s']} s)")  # fmt: skip
    print(f"  student   format {fmt['after']}/{fmt['of']}  facts {facts['after']}/{facts['of']}  "
          f"(gkd, no labels, {s['train_wall_s']} s)")  # fmt: skip
    print(f"  student loss per step: {s['loss_per_step']}")
    if written is not None:
        print(f"wrote {written}")


if __name__ == "__main__":
    sys.exit(main())
