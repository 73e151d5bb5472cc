"""How much CPU does a launch spend before its first optimizer step, before and after a change?

"before" is a git revision (default: the merge-base of HEAD with `main`), extracted with `git archive` into a
temporary folder and run from there (`PYTHONPATH=<it>/src`, its own `launchers/launch_finetune.py` and
`configs/demo.yaml`); "after" is this working tree. Both get the same launch command, the same data file
(this tree's `data/demo.jsonl`) and environment, and alternate in segments (before, after; then after,
before; ... over --repeats), after one untimed warm-up launch each (it compiles the extracted tree's `.pyc`
files and fills the tokenization and tiny-model caches), so machine noise falls on both.

What is measured (CPU-s = user + system, `getrusage(RUSAGE_CHILDREN)` of this process around the launch,
which covers the launcher and every rank it waited for):

- one-process launches (`python`): the CPU from process start to the end of the first optimizer step. The
  launch runs under `_first_step.py`, which imports `torch.optim.optimizer` (every run imports it before
  its first step anyway), registers a global optimizer-step post hook, and runs the launcher with
  `runpy`; the hook ends the process (`os._exit(0)`) right after the first `optimizer.step()` returns,
  so the child's rusage is exactly start -> first step. The hook also records the process's own CPU then
  (`os.times()`), printed beside it as a check.
- the 2-rank launch (`torchrun`): ranks cannot leave at the first step (ZeRO gathers parameters after the
  torch optimizer's step, a peer that left would fail the other), so the launch runs `train.max_steps=1`
  to the end: torchrun's own process plus both ranks from start to exit (the one step, the summary and
  the exit included, the same work on both sides). Each rank's CPU at its first step is recorded too.

Beside them, the floors on the same machine in the same run, each from start to the end of its code (it leaves
with `os._exit`, as the one-process launches leave at their first step): `python -c "import torch"`, a plain PyTorch
process that imports torch and takes one AdamW step on a linear layer (torch.optim imports torch._dynamo
when an optimizer is built, so every training process pays it), and a plain transformers process that loads
the tiny-llama's tokenizer and model as a launch does and takes one AdamW step on one example (what any
transformers training process of that model pays: above it is zerofit's own start-up). Then one `-X importtime`
run of the plain launch per side, summed by top-level package (self times; modules loaded through
`importlib.import_module`, as transformers' lazy modules are, are not logged by CPython, only what they import
in turn), and one of the floor "torch + one AdamW step": the launch's table less the floor's is what the
launch imports above any PyTorch training process, package by package.

This is a measurement, not a test: nothing here asserts on time.

    python benchmarks/startup.py                                  # before = merge-base with main
    python benchmarks/startup.py --before 23f5df4 --repeats 5 --json benchmarks/results/startup-<date>.json
    python benchmarks/startup.py --smoke --json /tmp/startup.json # 1 repeat, the plain launch only

`--smoke` falls back to comparing the working tree with itself where the revision cannot be found (a copy
without git history); the JSON says which.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASE = "main"
# Small and the same for every launch: 1 optimizer step of the demo's tiny-llama, fp32, a global batch of 4.
COMMON = (
    "train.max_steps=1",
    "train.precision=fp32",
    "batch.global_batch_size=4",
    "batch.micro_batch_size=2",
    "checkpoint.save_final=false",
    "logging.wandb.mode=disabled",
)
# name -> (launcher, ranks, overrides): the target (plain), the demo's LoRA on one process, and
# the demo itself (LoRA + DeepSpeed ZeRO-2) on 2 torchrun ranks.
LAUNCHES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "plain": ("python", 1, ("distributed.strategy=single", "lora.enabled=false")),
    "lora": ("python", 1, ("distributed.strategy=single",)),
    "torchrun-2rank-zero2-lora": ("torchrun", 2, ()),
}
FLOORS = {
    "import torch": "import torch",
    "torch + one AdamW step": (
        "import torch\nm = torch.nn.Linear(8, 8)\nopt = torch.optim.AdamW(m.parameters())\n"
        "m(torch.randn(2, 8)).sum().backward()\nopt.step()"
    ),
    # What any transformers training process of the tiny model pays (argv[1]: its folder): its tokenizer and
    # model loaded as a launch loads them (fp32, no Hub kernels), one example through forward and backward,
    # one AdamW step. The part of a launch above it is zerofit's own start-up.
    "torch + transformers, tiny-llama, one AdamW step": (
        "import sys, torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, use_kernels=False)\n"
        "opt = torch.optim.AdamW(model.parameters())\nids = torch.tensor([tok('12 + 7 = 19')['input_ids']])\n"
        "model(input_ids=ids, labels=ids).loss.backward()\nopt.step()"
    ),
}
FIRST_STEP = '''"""Run a launcher (argv[1:]) and note this process's CPU at the end of its first optimizer step."""
import json, os, runpy, sys
import torch.optim.optimizer as optimizer  # every run imports it before its first step

def _first_step(opt, args, kwargs):
    t = os.times()
    mark = {"rank": int(os.environ.get("RANK", "0")), "cpu_s": t.user + t.system}
    with open(os.path.join(os.environ["STARTUP_MARKS"], f"{os.getpid()}.json"), "w") as f:
        json.dump(mark, f)
    if os.environ.get("STARTUP_EXIT_AT_FIRST_STEP") == "1":
        os._exit(0)
    handle.remove()

handle = optimizer.register_optimizer_step_post_hook(_first_step)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''
EXIT_NOW = "\nimport os\nos._exit(0)"  # a floor's end: no interpreter finalization (`floor_once`)
# The floor whose imports the plain launch's are compared with, package by package (the import-time table's gap).
GAP_FLOOR = "torch + one AdamW step"
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)")


@dataclass
class Side:
    """One tree to launch from: its name, source root and where it came from."""

    name: str
    root: Path
    revision: str
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def git(*args: str) -> str:
    """A git command in the repository; raises CalledProcessError when it fails."""
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def default_revision() -> str:
    """The merge-base of HEAD with `main` (or `origin/main` in a clone without a local main)."""
    for base in (DEFAULT_BASE, f"origin/{DEFAULT_BASE}"):
        try:
            return git("merge-base", "HEAD", base)
        except (subprocess.CalledProcessError, FileNotFoundError):
            continue
    raise LookupError(f"no merge-base of HEAD with {DEFAULT_BASE} or origin/{DEFAULT_BASE}")


def before_side(revision: str | None, tmp: Path, smoke: bool) -> Side:
    """The "before" tree: `revision` (default: the merge-base with main) extracted into `tmp`; under --smoke,
    this working tree itself when the revision cannot be found (no git history)."""
    try:
        sha = git("rev-parse", "--verify", f"{revision or default_revision()}^{{commit}}")
    except (subprocess.CalledProcessError, FileNotFoundError, LookupError) as exc:
        if not smoke:
            raise SystemExit(
                f"startup.py: cannot find the revision to compare with ({exc}); pass --before REV"
            ) from None
        print(
            f"startup.py: no revision to compare with ({type(exc).__name__}); comparing the working tree with itself"
        )
        return Side("before", REPO, "working tree (no git history)")
    root = tmp / "before"
    root.mkdir()
    archive = subprocess.run(["git", "archive", sha], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return Side("before", root, sha)


def after_side() -> Side:
    """The "after" tree: this working tree (HEAD's commit, "+ changes" when it has uncommitted ones)."""
    try:
        head = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        head, dirty = "unknown", False
    return Side("after", REPO, f"working tree at {head}" + (" + changes" if dirty else ""))


def child_env(side: Side, marks: Path, exit_at_step: bool) -> dict[str, str]:
    """The launch's environment: this one, with `side`'s sources first and no outer launch's rendezvous."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHONPATH=str(side.root / "src"),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        STARTUP_MARKS=str(marks),
        STARTUP_EXIT_AT_FIRST_STEP="1" if exit_at_step else "0",
    )
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    return env


def launch_command(side: Side, name: str, wrapper: Path, out: Path, importtime: bool = False) -> list[str]:
    """The launch `name` from `side`'s tree, under the first-step wrapper."""
    launcher, ranks, overrides = LAUNCHES[name]
    python = [sys.executable, *(["-X", "importtime"] if importtime else [])]
    if launcher == "python":
        head = [*python, str(wrapper)]
    else:  # torchrun runs the wrapper as each rank's script
        head = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_port",
            str(free_port()),
            str(wrapper),
        ]
    config = [
        "--config",
        str(side.root / "configs" / "demo.yaml"),
        f"data.path={REPO / 'data' / 'demo.jsonl'}",
    ]
    return [
        *head,
        str(side.root / "launchers" / "launch_finetune.py"),
        *config,
        *COMMON,
        *overrides,
        f"output_dir={out}",
    ]


def free_port() -> int:
    """A free TCP port for torchrun's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_cpu() -> float:
    """User + system CPU-s of every child this process has waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_child(
    cmd: list[str], env: dict[str, str], cwd: Path
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run `cmd` to its end; its CPU-s (and its descendants') and its result. A failed launch stops the benchmark."""
    before = children_cpu()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    cpu = children_cpu() - before
    if proc.returncode != 0:
        raise SystemExit(
            f"startup.py: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    return cpu, proc


def launch_once(side: Side, name: str, tmp: Path, wrapper: Path, importtime: bool = False) -> dict[str, Any]:
    """One launch of `name` from `side`: its CPU-s and the first-step marks its processes wrote."""
    marks = Path(tempfile.mkdtemp(dir=tmp, prefix="marks-"))
    one_process = LAUNCHES[name][0] == "python"
    env = child_env(side, marks, exit_at_step=one_process)
    cmd = launch_command(side, name, wrapper, Path(tempfile.mkdtemp(dir=tmp, prefix="runs-")), importtime)
    cpu, proc = run_child(cmd, env, side.root)
    ranks = sorted((json.loads(p.read_text()) for p in marks.glob("*.json")), key=lambda m: m["rank"])
    if len(ranks) != LAUNCHES[name][1]:
        raise SystemExit(
            f"startup.py: {name} from {side.name}: {len(ranks)} processes reached a first optimizer step"
        )
    result = {"cpu_s": round(cpu, 3), "first_step_cpu_s_per_rank": [round(m["cpu_s"], 3) for m in ranks]}
    if importtime:
        result["importtime"] = proc.stderr
    return result


def floor_once(code: str, *args: str) -> float:
    """CPU-s of a fresh interpreter running `code` (with `args` as its argv[1:]), to the end of `code`: it
    leaves with `os._exit(0)` there, as a one-process launch leaves at the end of its first step (interpreter
    finalization after torch._dynamo is loaded costs ~0.3-0.9 CPU-s here, which neither side should count)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPROFILEIMPORTTIME"}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    return round(run_child([sys.executable, "-c", code + EXIT_NOW, *args], env, REPO)[0], 3)


def tiny_llama_folder(side: Side) -> str:
    """The built-in tiny-llama's folder, as `side`'s zerofit builds it (built now if it is not yet)."""
    env = {**os.environ, "PYTHONPATH": str(side.root / "src")}
    code = "from zerofit.models.tiny import ensure_tiny_model\nprint(ensure_tiny_model())"
    return run_child([sys.executable, "-c", code], env, side.root)[1].stdout.strip().splitlines()[-1]


def by_package(importtime: str) -> dict[str, float]:
    """`-X importtime` output summed by top-level package: seconds of self time, largest first."""
    total: Counter[str] = Counter()
    for line in importtime.splitlines():
        m = IMPORT_LINE.match(line)
        if m:
            total[m.group(3).split(".")[0]] += int(m.group(1)) / 1e6
    return {k: round(v, 4) for k, v in total.most_common()}


def measure(
    sides: tuple[Side, Side], names: list[str], repeats: int, tmp: Path, warmup: bool
) -> dict[str, Any]:
    """The launches, alternating sides each segment, and the floors between them."""
    wrapper = tmp / "_first_step.py"
    wrapper.write_text(FIRST_STEP)
    if warmup:
        for name in names:
            for side in sides:
                launch_once(side, name, tmp, wrapper)
    floors: dict[str, list[float]] = {k: [] for k in FLOORS}
    model = tiny_llama_folder(sides[1])
    for r in range(repeats):
        for name in names:
            for side in sides if r % 2 == 0 else sides[::-1]:
                side.runs.setdefault(name, []).append(launch_once(side, name, tmp, wrapper))
                print(
                    f"  segment {r + 1}/{repeats} {name:<26} {side.name:<6} {side.runs[name][-1]['cpu_s']:6.2f} CPU-s",
                    flush=True,
                )
        for key, code in FLOORS.items():
            floors[key].append(floor_once(code, model))
    imports = {
        side.name: by_package(launch_once(side, "plain", tmp, wrapper, importtime=True)["importtime"])
        for side in sides
    }
    imports[GAP_FLOOR] = by_package(floor_importtime(FLOORS[GAP_FLOOR]))
    return {"floors": floors, "importtime": imports}


def floor_importtime(code: str) -> str:
    """The `-X importtime` log of a fresh interpreter running `code`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPROFILEIMPORTTIME"}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    return run_child([sys.executable, "-X", "importtime", "-c", code], env, REPO)[1].stderr


def summarize(sides: tuple[Side, Side], names: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """Medians, the ratio after / before per launch (of the medians, and the median of the paired ratios)."""
    before, after = sides
    launches = {}
    for name in names:
        b, a = [r["cpu_s"] for r in before.runs[name]], [r["cpu_s"] for r in after.runs[name]]
        launches[name] = {
            "launcher": LAUNCHES[name][0],
            "ranks": LAUNCHES[name][1],
            "overrides": [*COMMON, *LAUNCHES[name][2]],
            "measured": "start to first optimizer step"
            if LAUNCHES[name][0] == "python"
            else "whole launch, 1 step",
            "before_cpu_s": b,
            "after_cpu_s": a,
            "before_first_step_cpu_s_per_rank": [r["first_step_cpu_s_per_rank"] for r in before.runs[name]],
            "after_first_step_cpu_s_per_rank": [r["first_step_cpu_s_per_rank"] for r in after.runs[name]],
            "median_before_cpu_s": round(statistics.median(b), 3),
            "median_after_cpu_s": round(statistics.median(a), 3),
            "ratio_after_before": round(statistics.median(a) / statistics.median(b), 3),
            "paired_ratio_median": round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 3),
        }
    floors = {
        k: {"cpu_s": v, "median_cpu_s": round(statistics.median(v), 3)} for k, v in extra["floors"].items()
    }
    return {"launches": launches, "floors": floors, "importtime_self_s_by_package": extra["importtime"]}


def print_report(report: dict[str, Any], top: int) -> None:
    """The ratios, the floors against the plain launch's before, and the import-time tables side by side."""
    print("\nCPU-s, median over segments (after / before):")
    for name, r in report["launches"].items():
        print(
            f"  {name:<26} before {r['median_before_cpu_s']:6.2f}  after {r['median_after_cpu_s']:6.2f}  "
            f"ratio {r['ratio_after_before']:.3f} (paired median {r['paired_ratio_median']:.3f}; {r['measured']})"
        )
    plain = report["launches"].get("plain")
    for key, f in report["floors"].items():
        share = (
            f" = {f['median_cpu_s'] / plain['median_before_cpu_s']:.2f} x plain's before, "
            f"{f['median_cpu_s'] / plain['median_after_cpu_s']:.2f} x its after"
            if plain
            else ""
        )
        print(f"  floor: {key:<24} {f['median_cpu_s']:6.2f}{share}")
    imports = report["importtime_self_s_by_package"]
    print(f"\n-X importtime of the plain launch, self seconds by top-level package (top {top}):")
    print(f"  {'before':<34}{'after':<34}")
    rows = [list(imports[s].items())[:top] for s in ("before", "after")]
    for i in range(top):
        cells = [f"{r[i][0]:<22}{r[i][1]:8.3f}    " if i < len(r) else " " * 34 for r in rows]
        print("  " + "".join(cells))
    print("  " + "".join(f"{'total':<22}{sum(imports[s].values()):8.3f}    " for s in ("before", "after")))
    print_gap(imports["after"], imports[GAP_FLOOR], top)


def print_gap(after: dict[str, float], floor: dict[str, float], top: int) -> None:
    """The plain launch's (after) import self time above the floor's, by top-level package, largest first."""
    gap = sorted(((k, v - floor.get(k, 0.0)) for k, v in after.items()), key=lambda kv: -kv[1])
    print(
        f"\n-X importtime of the plain launch (after) above the floor '{GAP_FLOOR}' (self seconds by package, top {top}):"
    )
    for name, seconds in gap[:top]:
        print(f"  {name:<22}{seconds:8.3f}")
    print(f"  {'total':<22}{sum(after.values()) - sum(floor.values()):8.3f}")


def main(argv: list[str] | None = None) -> int:
    """Measure, print and (with --json) write the before/after start-up CPU."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--before", default=None, help="git revision of 'before' (default: merge-base of HEAD with main)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="alternating segments (each: every launch, both sides)"
    )
    p.add_argument(
        "--launches", default=",".join(LAUNCHES), help=f"comma-separated, of {', '.join(LAUNCHES)}"
    )
    p.add_argument("--top", type=int, default=12, help="packages in the -X importtime table")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="1 segment, the plain launch, no warm-up")
    args = p.parse_args(argv)
    names = ["plain"] if args.smoke else [n for n in args.launches.split(",") if n]
    unknown = sorted(set(names) - set(LAUNCHES))
    if unknown:
        p.error(f"--launches: unknown {unknown}; choose from {list(LAUNCHES)}")
    tmp = Path(tempfile.mkdtemp(prefix="zerofit-startup-"))
    try:
        sides = (before_side(args.before, tmp, args.smoke), after_side())
        print(f"before: {sides[0].revision}\nafter:  {sides[1].revision}", flush=True)
        extra = measure(sides, names, 1 if args.smoke else args.repeats, tmp, warmup=not args.smoke)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "before": sides[0].revision,
        "after": sides[1].revision,
        "smoke": args.smoke,
        "repeats": 1 if args.smoke else args.repeats,
        **summarize(sides, names, extra),
    }
    print_report(report, args.top)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def machine() -> dict[str, Any]:
    """Where it ran: CPUs this process may use, platform, Python and the libraries' versions."""
    from importlib.metadata import version

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    libs = {name: version(name) for name in ("torch", "transformers", "peft", "deepspeed")}
    return {"cpus": cores, "platform": platform.platform(), "python": platform.python_version(), **libs}


if __name__ == "__main__":
    sys.exit(main())
