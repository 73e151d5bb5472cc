"""What does `zerofit plan` cost against `python -c "import torch"`, per shipped config?

`zerofit plan --config C` is what a user runs over and over while choosing a recipe (and what the studio's
plan page calls on every change): issue 47 asks for at most 1.5x the CPU time of importing torch on the same
machine. Each measurement is one child process (`python -m zerofit.cli plan --config C`, or `python -c
"import torch"`), its CPU time the user + system seconds of the child (`resource.getrusage(RUSAGE_CHILDREN)`
before and after), so the other processes of a shared machine do not count, only their contention does.

With `--cold`, every plan (the first, each segment's, the baseline's) runs on an empty `$ZEROFIT_CACHE` of its
own: what a user's first plan of a model costs (dense families read from their configs alone, the others built
on the meta device, `zerofit.planner.config_shapes`). Without it, each config is planned once untimed first: the first plan of a model fills the planner's cache
(`$ZEROFIT_CACHE/planner/`: the shapes and LoRA counts of a meta-device build, `zerofit.core.derived_cache`), which
every later plan of it reads; that first run's CPU time is reported apart (`first_cpu_s`: a cold cache only if
the cache held nothing for it). Then --repeats segments, each config's plan next to an `import torch` in every
segment, alternating, so machine noise falls on both. Reported per config: the median of each and their
ratio; the worst ratio over the configs. `--baseline-src DIR` also times another checkout's plan in the same
segments (before / after a change, on the same machine at the same time). Every plan's output is also searched for bitsandbytes' hub-kernel
message ("gemm_4bit"), which must never reach it.

This is a measurement, not a test: nothing here asserts on time.

    python benchmarks/plan_speed.py                                   # every configs/*.yaml, 3 repeats
    python benchmarks/plan_speed.py --configs configs/demo.yaml --repeats 5 --json out.json
    python benchmarks/plan_speed.py --smoke --json /tmp/plan_speed.json   # one config, one repeat
    python benchmarks/plan_speed.py --baseline-src ../main/src         # and another checkout's plan, same segments
    python benchmarks/plan_speed.py --cold --json out.json             # every plan on an empty cache

Run from the repository root (configs name data paths relative to it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
IMPORT_TORCH = (sys.executable, "-c", "import torch")
HUB_KERNEL_MESSAGE = (
    "gemm_4bit"  # bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community"
)
SMOKE_CONFIG = "configs/demo.yaml"


def child_cpu_s(args: tuple[str, ...], src: str | None = None, cold: bool = False) -> tuple[float, str]:
    """User + system CPU seconds of one child process running `args` (with `src` first on its PYTHONPATH:
    another checkout's zerofit; `cold`: on an empty `$ZEROFIT_CACHE` of its own), and its stdout + stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    if cold:
        with tempfile.TemporaryDirectory(prefix="zerofit-cold-") as cache:
            return _run(args, {**env, "ZEROFIT_CACHE": cache})
    return _run(args, env)


def _run(args: tuple[str, ...], env: dict[str, str]) -> tuple[float, str]:
    """`child_cpu_s` of one child with its environment."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, proc.stdout + proc.stderr


def plan_command(config: str) -> tuple[str, ...]:
    """`zerofit plan --config CONFIG`, through this interpreter (the `zerofit` script runs the same main)."""
    return (sys.executable, "-m", "zerofit.cli", "plan", "--config", config)


def measure(configs: list[str], repeats: int, baseline: str | None, cold: bool = False) -> dict[str, Any]:
    """Every config's first plan, then `repeats` segments of (import torch, plan[, the baseline's plan]) per
    config; the medians and ratios per config and the worst ratio. `cold`: every plan on an empty cache."""
    kinds = ("plan", "import_torch", *(["baseline_plan"] if baseline else []))
    samples = {c: {k: [] for k in kinds} for c in configs}
    first, messages = {}, set()
    for config in configs:
        first[config], out = child_cpu_s(plan_command(config), cold=cold)
        if baseline:  # the baseline's own first plan (its cache keys are its own)
            child_cpu_s(plan_command(config), baseline, cold=cold)
        messages |= {config} if HUB_KERNEL_MESSAGE in out else set()
    for _ in range(repeats):
        for config in configs:
            samples[config]["import_torch"].append(child_cpu_s(IMPORT_TORCH)[0])
            cpu, out = child_cpu_s(plan_command(config), cold=cold)
            samples[config]["plan"].append(cpu)
            messages |= {config} if HUB_KERNEL_MESSAGE in out else set()
            if baseline:
                samples[config]["baseline_plan"].append(
                    child_cpu_s(plan_command(config), baseline, cold=cold)[0]
                )
    rows = {c: _row(samples[c], first[c]) for c in configs}
    worst = max(rows, key=lambda c: rows[c]["ratio"])
    return {
        "configs": rows,
        "worst": {"config": worst, "ratio": rows[worst]["ratio"]},
        "hub_kernel_message_in": sorted(messages),
    }


def _row(samples: dict[str, list[float]], first: float) -> dict[str, Any]:
    """One config's medians, its ratio to importing torch (and the baseline's), and the samples."""
    median = {kind: statistics.median(values) for kind, values in samples.items()}
    row: dict[str, Any] = {
        "plan_cpu_s": round(median["plan"], 3),
        "import_torch_cpu_s": round(median["import_torch"], 3),
        "ratio": round(median["plan"] / median["import_torch"], 3),
        "first_cpu_s": round(first, 3),
    }
    if "baseline_plan" in median:
        row["baseline_plan_cpu_s"] = round(median["baseline_plan"], 3)
        row["baseline_ratio"] = round(median["baseline_plan"] / median["import_torch"], 3)
    row["samples"] = {kind: [round(v, 3) for v in values] for kind, values in samples.items()}
    return row


def machine() -> dict[str, Any]:
    """Where the numbers were taken: CPU, cores this process may use, Python and library versions."""
    from importlib.metadata import version

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                      if ln.startswith("model name")), "")  # fmt: skip
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cores": cores,
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "peft": version("peft"),
    }


def report_lines(result: dict[str, Any]) -> list[str]:
    """The printed table: each config's CPU seconds and ratio, then the worst."""
    lines = [
        f"{'config':44} {'plan CPU-s':>10} {'torch CPU-s':>11} {'ratio':>6} {'first':>6} {'baseline':>9}"
    ]
    for config, row in result["configs"].items():
        base = (
            f"{row['baseline_plan_cpu_s']:5.2f} {row['baseline_ratio']:4.2f}x"
            if "baseline_ratio" in row
            else ""
        )
        lines.append(
            f"{Path(config).name:44} {row['plan_cpu_s']:10.2f} {row['import_torch_cpu_s']:11.2f} "
            f"{row['ratio']:5.2f}x {row['first_cpu_s']:6.2f} {base}"
        )
    worst = result["worst"]
    lines.append(f"worst: {Path(worst['config']).name} at {worst['ratio']:.2f}x the CPU time of import torch")
    found = result["hub_kernel_message_in"]
    lines.append(f"bitsandbytes' hub-kernel message in the output of: {', '.join(found) or 'none'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--configs", nargs="+", default=None, help="config files (default: configs/*.yaml)")
    parser.add_argument("--repeats", type=int, default=3, help="segments of (import torch, plan) per config")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result here")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_CONFIG} only, one repeat")
    parser.add_argument(
        "--baseline-src",
        default=None,
        metavar="DIR",
        help="also time the plan of another checkout's zerofit (its src/ folder) in the same segments",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="every plan on an empty $ZEROFIT_CACHE of its own (a user's first plan of each model)",
    )
    parser.add_argument("--note", default="", help="a line about the machine or the run, kept in the JSON")
    args = parser.parse_args(argv)
    configs = args.configs or sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml"))
    repeats = args.repeats
    if args.smoke:
        configs, repeats = [SMOKE_CONFIG], 1
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {**machine(), "note": args.note},
        "repeats": repeats,
        "baseline_src": args.baseline_src,
        "cold": args.cold,
        **measure(configs, repeats, args.baseline_src, args.cold),
    }
    lines = report_lines(result)
    if args.json is not None:  # the result first, then where it went
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        lines.append(f"wrote {args.json}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
