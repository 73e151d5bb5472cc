"""Run `launchers/launch_finetune.py` through the real launchers (python, deepspeed, torchrun) in tests.

Launches of one test module are started together (a few at a time) so their start-up costs overlap; each
gets its own free rendezvous port and run name, and a one-process launch beside others gets its share of
the cores (OMP_NUM_THREADS). Results expose the run directory's metrics and export.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launchers" / "launch_finetune.py"
BIN = Path(sys.executable).parent


# Rendezvous ports come from below Linux's ephemeral range (32768-60999), where the kernel picks the ports of
# outgoing connections and of bind(0): a port it handed out is free only until someone else gets it, and
# gloo's many connections, or the other pytest-xdist worker's bind(0), could take it before the launcher
# binds it. Each xdist worker draws from its own band, so two workers never offer the same port.
PORTS = range(20000, 32000)
_next_port: list[int] = []  # this process's next candidate, from a random start in its band


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no other worker of this test run will offer."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = len(PORTS) // max(workers, 1)
    start = PORTS.start + worker * width
    if not _next_port:
        import random

        _next_port.append(random.randrange(width))
    for _ in range(width):
        port = start + _next_port[0] % width
        _next_port[0] += 1
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken (or in TIME_WAIT): the next one
            return port
    raise RuntimeError(f"no free port in {start}-{start + width - 1}")


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass(frozen=True)
class Launch:
    """One launch: a run name, the launcher (`python`, `deepspeed`, `torchrun`) and dotted overrides."""

    name: str
    launcher: str
    overrides: tuple[str, ...] = ()
    nproc: int = 2
    key: str = ""  # results/log key when several launches share a run name (default: the name)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for this launch only
    # Send a signal mid-run: (signal, "launcher" | "group", rows) sends it to the launcher process (or its
    # whole process group, as a terminal's Ctrl-C or a scheduler does) once metrics.jsonl has `rows` more
    # rows than when the launch started.
    interrupt: tuple[int, str, int] | None = None
    # This launch's own config file (default: the one `run_launches` is given), so that launches of different
    # jobs can run side by side: one whose ranks sit idle (a fault's delay) beside others that use the cores.
    config: Path | None = None

    @property
    def id(self) -> str:
        return self.key or self.name

    def command(self, config: Path, output_dir: Path) -> list[str]:
        if self.launcher == "python":
            head = [sys.executable]
        elif self.launcher == "deepspeed":
            head = [str(BIN / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(self.nproc)]
        elif self.launcher == "torchrun":
            head = [
                str(BIN / "torchrun"),
                "--master_port",
                str(free_port()),
                "--nproc_per_node",
                str(self.nproc),
            ]
        else:
            raise ValueError(self.launcher)
        args = ["--config", str(config), f"output_dir={output_dir}", f"run_name={self.name}", *self.overrides]
        return [*head, str(LAUNCHER), *args]


@dataclass
class RunResult:
    """A finished launch: exit code, output, wall time and its run directory."""

    launch: Launch
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    run_dir: Path
    _metrics: list[dict[str, Any]] | None = field(default=None, repr=False)

    def check(self) -> RunResult:
        assert self.returncode == 0, f"{self.launch}\n{self.stdout[-4000:]}\n{self.stderr[-4000:]}"
        return self

    @property
    def metrics(self) -> list[dict[str, Any]]:
        if self._metrics is None:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
            self._metrics = [json.loads(line) for line in lines]
        return self._metrics

    def series(self, key: str) -> list[Any]:
        return [row[key] for row in self.metrics]

    def exported(self) -> dict[str, Any]:
        """The final export's tensors (`model/` or `adapter/` safetensors)."""
        from safetensors.torch import load_file

        for sub, name in (("model", "model.safetensors"), ("adapter", "adapter_model.safetensors")):
            if (self.run_dir / sub / name).is_file():
                return load_file(self.run_dir / sub / name)
        raise FileNotFoundError(f"no export in {self.run_dir}")


def run_launches(
    launches: Iterable[Launch],
    config: Path,
    output_dir: Path,
    max_parallel: int = 2,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> dict[str, RunResult]:
    """Start every launch (at most `max_parallel` at a time) and wait for all; results by `Launch.id`."""
    pending = list(launches)
    running: list[tuple[Launch, subprocess.Popen[str], float, Path, Path]] = []
    interrupts: dict[int, tuple[int, str, int, Path]] = {}  # pid -> (signal, target, rows to reach, metrics)
    results: dict[str, RunResult] = {}
    base_env = {**os.environ, **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base_env.pop(key, None)  # every launch brings its own rendezvous
    logs = output_dir / "_logs"
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    side_by_side = min(max_parallel, len(pending))
    while pending or running:
        while pending and len(running) < max_parallel:
            launch = pending.pop(0)
            out, err = logs / f"{launch.id}.out", logs / f"{launch.id}.err"
            proc = subprocess.Popen(
                launch.command(launch.config or config, output_dir),
                cwd=REPO,
                env={**base_env, **_cpu_share(launch, side_by_side, base_env), **launch.env},
                stdout=out.open("w"),
                stderr=err.open("w"),
                text=True,
                start_new_session=True,  # so a timeout can stop the launcher and all its ranks
            )
            running.append((launch, proc, time.monotonic(), out, err))
            if launch.interrupt is not None:
                sig, target, rows = launch.interrupt
                metrics = output_dir / launch.name / "metrics.jsonl"
                interrupts[proc.pid] = (sig, target, _rows(metrics) + rows, metrics)
        for item in list(running):
            launch, proc, started, out, err = item
            if proc.pid in interrupts and _rows(interrupts[proc.pid][3]) >= interrupts[proc.pid][2]:
                sig, target, _, _ = interrupts.pop(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    (os.killpg if target == "group" else os.kill)(proc.pid, sig)
            # Done when the launcher has exited and nothing of its process group is left (the deepspeed
            # runner dies at once on a signal while launch.py and the ranks finish their stop).
            if proc.poll() is None or _group_alive(proc.pid):
                if time.monotonic() < deadline:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            running.remove(item)
            results[launch.id] = RunResult(
                launch=launch,
                returncode=proc.returncode,
                stdout=out.read_text(),
                stderr=err.read_text(),
                seconds=time.monotonic() - started,
                run_dir=output_dir / launch.name,
            )
        time.sleep(0.02 if interrupts else 0.1)
    return results


def _cpu_share(launch: Launch, side_by_side: int, env: dict[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS for a one-process launch that runs beside other work: its share of the cores.

    A lone process on CPU takes a thread per core (torch's default; zerofit splits the cores between the
    ranks of a multi-rank launch itself, `strategies/base.py` `limit_cpu_threads`). Beside another launch
    that is more threads than cores, and torch's OpenMP threads then wait for each other at every op: on
    2 cores, two 20-step single-process runs of the demo config side by side took 35-40 s of CPU each
    instead of 7, and 43-83 s of training instead of 2-4 s. Under pytest-xdist the other workers' tests
    run beside it too: the share is the cores over (launches side by side x workers), never more than an
    OMP_NUM_THREADS already set (by the user, or tests/conftest.py's per-worker share).
    """
    one_process = launch.launcher == "python" or launch.nproc == 1  # (`nproc` means nothing to python)
    workers = int(env.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if not one_process or side_by_side * workers < 2:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // (side_by_side * workers))
    given = env.get("OMP_NUM_THREADS", "")
    return {"OMP_NUM_THREADS": str(min(share, int(given)) if given.isdigit() and int(given) > 0 else share)}


def _rows(metrics: Path) -> int:
    try:
        return len(metrics.read_text().splitlines())
    except OSError:
        return 0


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process of process group `pgid` is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    import psutil  # (a DeepSpeed dependency)

    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


def run_one(launch: Launch, config: Path, output_dir: Path, **kwargs: Any) -> RunResult:
    return run_launches([launch], config, output_dir, max_parallel=1, **kwargs)[launch.id]


def varied_length_data(path: Path, n: int, seed: int = 0) -> Path:
    """`n` prompt/response pairs whose lengths vary from 1 to ~60 characters: padding and token counts
    differ a lot between micro-batches, which is what breaks per-micro-batch loss means."""
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice("abcdefghij") for _ in range(rng.choice([1, 2, 3, 20, 40])))
            response = "".join(rng.choice("0123456789") for _ in range(rng.choice([1, 2, 5, 30, 60])))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    return path


def copy_as_interrupted(src: Path, dst: Path, stopped_at: int, last_step: int) -> None:
    """A copy of run directory `src` as if the run had stopped right after its step-`stopped_at` checkpoint."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step-{last_step}")
    for export in ("adapter", "model"):  # LoRA's or full fine-tuning's final export
        shutil.rmtree(dst / export, ignore_errors=True)
    rows = (src / "metrics.jsonl").read_text().splitlines()[:stopped_at]
    (dst / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def run_and_resume(
    launches: list[Launch],
    config: Path,
    output_dir: Path,
    resumed: dict[str, str],
    stopped_at: int,
    last_step: int,
) -> dict[str, RunResult]:
    """Run `launches`; then, for each `name -> resumed_name`, copy run `name` as if it had been stopped right
    after its step-`stopped_at` checkpoint and resume that copy with the same launcher and overrides.

    Results of both the straight runs and the resumed copies, by name.
    """
    results = run_launches(launches, config, output_dir)
    by_name = {launch.name: launch for launch in launches}
    again = []
    for name, copy_name in resumed.items():
        copy_as_interrupted(results[name].check().run_dir, output_dir / copy_name, stopped_at, last_step)
        base = by_name[name]
        again.append(
            Launch(copy_name, base.launcher, (*base.overrides, "checkpoint.resume=true"), base.nproc)
        )
    results.update(run_launches(again, config, output_dir))
    return results
