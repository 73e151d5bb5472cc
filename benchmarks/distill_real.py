"""On-policy distillation on the real pretrained model: a student SmolLM2-135M-Instruct + LoRA, with no
labels, learns the demo's JSON answer format from a teacher; the held-out format score before and after, on CPU.

    1. The teacher is the demo's run (`configs/demo-smollm2.yaml`: SmolLM2 + LoRA learns to answer as one JSON
       object {"answer": "..."} from 67 short chats): `--teacher-run` an existing one (`make demo`'s), else
       trained here by `zerofit.train` on one process in fp32 (the demo's 24 steps, learning rate and LoRA);
       then exported merged in fp32 by `zerofit export --merge`: the teacher is that export folder
       (`gkd.teacher`).
    2. The student is the base `smollm2-135m-instruct` + LoRA (the demo's r 8), `train.objective: gkd` with
       `gkd.lmbda: 1` (every completion is the student's own sample: no completion column, no labels) and
       `gkd.beta: 1` (the reverse KL of on-policy distillation, Agarwal et al. 2024, Qwen3's and Thinking
       Machines'), on the demo's own 67 questions as prompts only (their answers are dropped).
    3. The base (the student run with its adapters off), the student and the teacher each answer the demo's
       held-out prompts once, greedily, through the demo scorer's own `generate_replies` and checks: 20 new
       questions, a reply passing when it is exactly one JSON object {"answer": ...} (the format), and 16
       capitals the base knows (facts).

    python benchmarks/distill_real.py --teacher-run runs/demo-smollm2-json   # ~15 min on 2 shared cores
    python benchmarks/distill_real.py --json benchmarks/results/distill_real-smollm2-<date>.json
    python benchmarks/distill_real.py optimizer.lr=5e-4         # overrides of the student's run
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

import yaml

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
    "train.max_steps=16",
    "optimizer.lr=1.0e-3",
    "scheduler.warmup_steps=2",
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


def _passes(model: Any, tokenizer: Any, task: list[Any], facts: list[Any]) -> dict[str, Any]:
    """One model's greedy replies to the held-out probes (the demo's `generate_replies`, each stopped once its
    verdict is settled, the first 2 task replies whole) and how many pass the demo's checks."""
    from zerofit.demo.score import follows_format, format_settled, generate_replies, knows

    settled = [None, None, *([format_settled] * (len(task) - 2))]
    settled += [lambda reply, a=p.answer: knows(reply, a) for p in facts]
    replies = generate_replies(model, tokenizer, [p.prompt for p in [*task, *facts]], settled=settled)
    said, known = replies[: len(task)], replies[len(task) :]
    return {
        "format": sum(follows_format(r) for r in said),
        "facts": sum(knows(r, p.answer) for r, p in zip(known, facts, strict=True)),
        "samples": said[:2],
    }


def score(student_dir: Path, teacher: Path, task_file: Path, facts_file: Path) -> dict[str, Any]:
    """The held-out format and facts of the base (the student run with its adapters off), the distilled
    student and the teacher, each once."""
    from zerofit.demo.score import read_probes
    from zerofit.trained import load_trained
    from zerofit.trained.generate import load_generator

    task, facts = read_probes(task_file), read_probes(facts_file)
    student = load_trained(student_dir)
    student.model.eval()
    with student.model.disable_adapter():
        base = _passes(student.model, student.tokenizer, task, facts)
    after = _passes(student.model, student.tokenizer, task, facts)
    taught = load_generator(teacher)
    return {
        "of": {"format": len(task), "facts": len(facts)},
        "base": base,
        "student": after,
        "teacher": _passes(taught.model, taught.tokenizer, task, facts),
    }


def teacher_export(runs: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The teacher: the demo's run (`--teacher-run`, else trained here on one process in fp32) exported
    merged by `zerofit export --merge`; its folder and where it came from."""
    import zerofit

    started = time.perf_counter()
    if args.teacher_run is not None:
        run_dir, source = args.teacher_run, {"run": str(args.teacher_run), "trained_here": False}
    else:
        extra = [*ONE_PROCESS, *(SMOKE if args.smoke else ())]
        run_dir = zerofit.train(
            str(DEMO), output_dir=str(runs), run_name="teacher", **_as_kwargs(extra)
        ).run_dir
        source = {"run": "configs/demo-smollm2.yaml", "overrides": extra, "trained_here": True}
    recorded = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    source["run_config"] = {
        k: recorded[k] for k in ("model", "train", "optimizer", "lora", "distributed", "batch")
    }
    losses = [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    source["loss_first_last"] = [round(losses[0], 4), round(losses[-1], 4)]
    export = runs / "teacher-merged"
    zerofit_bin = Path(sys.executable).parent / "zerofit"
    command = [
        str(zerofit_bin),
        "export",
        str(run_dir),
        "--merge",
        "--dtype",
        "fp32",
        "--out",
        str(export),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    source["wall_s"] = round(time.perf_counter() - started, 1)
    return export, source


def _as_kwargs(items: list[str]) -> dict[str, Any]:
    """`key=value` overrides as `zerofit.train`'s keyword overrides (dotted keys, values as YAML reads them)."""
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
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, 1 step each, 3 probes per set")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--runs", type=Path, default=None, help="where the run folders go (default: a temp)")
    parser.add_argument("--teacher-run", type=Path, default=None, help="the demo's run (default: train it)")
    parser.add_argument("overrides", nargs="*", help="overrides of the student's run, key=value")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """The teacher, the student, and the scores of the base, the student and the teacher."""
    task, facts = (
        _probes(TASK, runs / "task.jsonl", args.smoke),
        _probes(FACTS, runs / "facts.jsonl", args.smoke),
    )
    teacher, source = teacher_export(runs, args)
    prompts = prompts_only(REPO / "data" / "demo_smollm2.jsonl", runs / "prompts.jsonl")
    student, student_s = train_student(runs, teacher, prompts, args)
    started = time.perf_counter()
    scores = score(student.run_dir, teacher, task, facts)
    return {
        "teacher": source,
        "student": {
            "train_wall_s": round(student_s, 1),
            "loss_per_step": [(r["step"], round(r["loss"], 4)) for r in student.metrics if "loss" in r],
            "on_policy_fraction": [r.get("on_policy_fraction") for r in student.metrics if "loss" in r],
        },
        "heldout": {**scores, "scoring_wall_s": round(time.perf_counter() - started, 1)},
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
    h, of = report["heldout"], report["heldout"]["of"]
    print(f"{report['model']}: held-out format (one JSON object) and facts, greedy")
    for who, what in (("base", "no training"), ("teacher", "the demo's SFT run, merged"),
                      ("student", f"gkd, no labels, {report['student']['train_wall_s']} s")):  # fmt: skip
        row = h[who]
        print(
            f"  {who:8s}  format {row['format']}/{of['format']}  facts {row['facts']}/{of['facts']}  ({what})"
        )
    print(f"  student loss per step: {report['student']['loss_per_step']}")
    if written is not None:
        print(f"wrote {written}")


if __name__ == "__main__":
    sys.exit(main())
