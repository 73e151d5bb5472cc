"""Run trainings in tests: `launchers/launch_finetune.py` through the real launchers (python, deepspeed,
torchrun), or, for a one-process reference run, the Python API (`zerofit.train`) in the test's own process.

Launches of one test module are started together (a few at a time) so their start-up costs overlap; each
gets its own free rendezvous port and run name, and a one-process launch beside others gets its share of
the cores (OMP_NUM_THREADS). An `api` launch runs in this process's main thread while the others are
started and polled from a background thread; it costs no process start-up (~4.5 CPU-s of imports this
process has done already) and leaves this process's state (environment, default dtype, RNG, threads) as it
found it. Results expose the output, the run directory's metrics and export.

Every launch is recorded under the test module that started it (`launched_by`), and each such module must
list it, with its launcher, in its docstring's `launch  launcher ...` table (`unlisted`, checked by
tests/conftest.py after the module's tests): a module's list of what it covers cannot drift from what it runs.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from warm_launch import WarmLaunch, start_zygote
from zerofit.strategies.env import RENDEZVOUS_VARIABLES

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launchers" / "launch_finetune.py"
BIN = Path(sys.executable).parent
ONE_PROCESS = ("python", "api")  # the launchers that run one process whatever `nproc` says
_launched: dict[str, set[tuple[str, str]]] = {}  # test module file -> {(launch id, launcher)}


# Rendezvous ports come from below Linux's ephemeral range (32768-60999), where the kernel picks the ports of
# outgoing connections and of bind(0): a port it handed out is free only until someone else gets it, and
# gloo's many connections, or the other pytest-xdist worker's bind(0), could take it before the launcher
# binds it. Each xdist worker draws from its own band, so two workers never offer the same port.
PORTS = range(20000, 32000)
_next_port: list[int] = []  # this process's next candidate, from a random start in its band


def worker_ports() -> range:
    """This pytest-xdist worker's band of `PORTS`: the only ports its launches rendezvous on."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = len(PORTS) // max(workers, 1)
    return range(PORTS.start + worker * width, PORTS.start + (worker + 1) * width)


DEEPSPEED_SHM_SEGMENTS = "deepspeed_allreduce_buffer_*"  # ..._<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>


def deepspeed_shm_segments(root: Path = Path("/dev/shm")) -> set[Path]:
    """DeepSpeed's CPU allreduce segments in /dev/shm of this worker's launches: those on its own band of
    rendezvous ports (`worker_ports`), so the other pytest-xdist worker's launches, running meanwhile, leave
    theirs out of the count."""
    ports = {str(port) for port in worker_ports()}
    return {p for p in root.glob(DEEPSPEED_SHM_SEGMENTS) if p.name.split("_")[-2] in ports}


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no other worker of this test run will offer."""
    band = worker_ports()
    start, width = band.start, len(band)
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
    """One launch: a run name, the launcher and dotted overrides.

    Launchers: `python`, `deepspeed`, `torchrun` start `launchers/launch_finetune.py` in a new process;
    `api` runs `zerofit.train` in this one (no ~4.5 CPU-s of imports: for one-process reference runs);
    `warm` forks its ranks, with torchrun's worker environment, from a process that has imported what a
    rank imports (tests/warm_launch.py: for the launches of an equivalence matrix beyond the one run per
    property through the real launcher it claims).
    """

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
        if threading.current_thread() is threading.main_thread():  # `run_launches` recorded its own
            _record([self])
        if self.launcher == "python":
            head = [sys.executable]
        elif self.launcher == "warm":  # ranks forked by tests/warm_launch.py run the entry point itself
            head = []
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
    """Start every launch (at most `max_parallel` at a time) and wait for all; results by `Launch.id`.

    `api` launches run one after another in this process's main thread (the only one where Python lets code
    set signal handlers) while a background thread starts and polls the subprocess launches; each `api`
    launch takes one of the `max_parallel` places while it runs. `timeout` stops only subprocess launches.
    """
    pending = list(launches)
    _record(pending)
    in_process = [launch for launch in pending if launch.launcher == "api"]
    processes = [launch for launch in pending if launch.launcher != "api"]
    logs = output_dir / "_logs"
    logs.mkdir(parents=True, exist_ok=True)
    base_env = _launch_env(env)  # read before an api launch changes this process's environment
    if any(launch.launcher == "warm" for launch in processes):
        start_zygote()  # (as well, before an api launch changes it)
    side_by_side = min(max_parallel, len(pending))
    if not in_process:
        return _run_processes(
            processes, config, output_dir, (lambda: max_parallel, side_by_side), timeout, base_env
        )
    busy = threading.Event()  # set while an api launch runs (it takes a place)
    busy.set()
    results: dict[str, RunResult] = {}
    failure: list[BaseException] = []

    def poll() -> None:
        try:
            places = lambda: max(1, max_parallel - busy.is_set())  # noqa: E731
            ran = _run_processes(processes, config, output_dir, (places, side_by_side), timeout, base_env)
            results.update(ran)
        except BaseException as exc:  # re-raised in the main thread
            failure.append(exc)

    thread = threading.Thread(target=poll, name="run_launches", daemon=True)
    thread.start()
    try:
        for launch in in_process:
            share = _cpu_share(launch, side_by_side, base_env)
            results[launch.id] = run_in_process(
                launch, launch.config or config, output_dir, {**(env or {}), **share, **launch.env}
            )
    finally:
        busy.clear()
        thread.join()
    if failure:
        raise failure[0]
    return results


def _run_processes(
    launches: list[Launch],
    config: Path,
    output_dir: Path,
    places_side_by_side: tuple[Callable[[], int], int],
    timeout: float,
    base_env: dict[str, str],
) -> dict[str, RunResult]:
    """The subprocess launches of `run_launches`: at most `places()` running at a time, each given its
    share of the cores as one of `side_by_side` launches."""
    places, side_by_side = places_side_by_side
    pending = list(launches)
    running: list[tuple[Launch, subprocess.Popen[str], float, Path, Path]] = []
    interrupts: dict[int, tuple[int, str, int, Path]] = {}  # pid -> (signal, target, rows to reach, metrics)
    results: dict[str, RunResult] = {}
    logs = output_dir / "_logs"
    deadline = time.monotonic() + timeout
    while pending or running:
        while pending and len(running) < places():
            launch = pending.pop(0)
            out, err = logs / f"{launch.id}.out", logs / f"{launch.id}.err"
            command = launch.command(launch.config or config, output_dir)
            launch_env = {**base_env, **_cpu_share(launch, side_by_side, base_env), **launch.env}
            proc: Any
            if launch.launcher == "warm":
                assert launch.interrupt is None, "a warm launch has no launcher process to signal"
                proc = WarmLaunch(command, launch_env, REPO, out, err, launch.nproc)
            else:
                proc = subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=launch_env,
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
            warm = launch.launcher == "warm"  # (its ranks are all it has)
            if proc.poll() is None or (not warm and _group_alive(proc.pid)):
                if time.monotonic() < deadline:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    proc.kill() if warm else os.killpg(proc.pid, signal.SIGKILL)
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


def _launch_env(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment plus `env`, without a rendezvous (every launch brings its own)."""
    base_env = {**os.environ, **(env or {})}
    for key in RENDEZVOUS_VARIABLES:
        base_env.pop(key, None)  # every launch brings its own rendezvous
    return base_env


def run_in_process(launch: Launch, config: Path, output_dir: Path, env: dict[str, str]) -> RunResult:
    """One `api` launch: `zerofit.train` in this process with the launch's overrides (parsed as the command
    line parses them) and `env` set, its stdout/stderr captured; this process's state is restored after.

    What a `python` launch would exit with: 0, or non-zero with the traceback on stderr (2 for a user
    error, as the launcher), and its Python warnings on stderr. Its output is also written to `_logs/`, as a
    subprocess launch's is.
    """
    _record([launch])
    import zerofit
    from zerofit.config.loader import parse_overrides
    from zerofit.core.errors import ZerofitError
    from zerofit.recipe.run import EXIT_USER_ERROR

    out, err = io.StringIO(), io.StringIO()
    started, code = time.monotonic(), 0
    args = [f"output_dir={output_dir}", f"run_name={launch.name}", *launch.overrides]
    with (
        _worker_state_kept(env),
        _python_path(env.get("PYTHONPATH", "")),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _warnings_printed(),
    ):
        try:
            zerofit.train(config, **parse_overrides(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            traceback.print_exc()
        except Exception as exc:
            code = EXIT_USER_ERROR if isinstance(exc, ZerofitError) else 1
            traceback.print_exc()
    logs = output_dir / "_logs"
    (logs / f"{launch.id}.out").write_text(out.getvalue())
    (logs / f"{launch.id}.err").write_text(err.getvalue())
    return RunResult(
        launch=launch,
        returncode=code,
        stdout=out.getvalue(),
        stderr=err.getvalue(),
        seconds=time.monotonic() - started,
        run_dir=output_dir / launch.name,
    )


@contextlib.contextmanager
def _python_path(pythonpath: str) -> Iterator[None]:
    """PYTHONPATH's new folders first on `sys.path`, as a new process puts them (a user's reward module, say);
    afterwards `sys.path` as it was and the modules the run imported from those folders forgotten."""
    known = {str(Path(entry or ".").resolve()) for entry in sys.path}
    folders = [str(Path(entry).resolve()) for entry in pythonpath.split(os.pathsep) if entry]
    folders = [folder for folder in dict.fromkeys(folders) if folder not in known]
    before, imported = list(sys.path), set(sys.modules)
    sys.path[:0] = folders
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path[:] = before
        roots = tuple(folder + os.sep for folder in folders)
        for name in set(sys.modules) - imported if roots else ():
            file = getattr(sys.modules[name], "__file__", None)
            if file and str(Path(file).resolve()).startswith(roots):
                del sys.modules[name]


@contextlib.contextmanager
def _warnings_printed() -> Iterator[None]:
    """Python warnings printed to stderr under a new process's filters, as a launched run's are (pytest would
    otherwise record an in-process run's library warnings into its own summary)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()  # then Python's defaults: these ignored, the rest shown once per place
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category, append=True)
        warnings.showwarning = _print_warning
        yield


def _print_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: Any = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _worker_state_kept(env: dict[str, str]) -> Iterator[None]:
    """Run a training in this process as a launched one starts (no rendezvous, `env` set, OMP_NUM_THREADS's
    threads), and leave nothing of it behind: the environment, torch's default dtype, thread count and
    deterministic flag, the RNG states, SIGINT/SIGTERM handlers and a process group it left are restored."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    environ = dict(os.environ)
    for key in RENDEZVOUS_VARIABLES:
        os.environ.pop(key, None)
    os.environ.update(env)
    dtype, threads, deterministic = (
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
    )
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    had_group = dist.is_available() and dist.is_initialized()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what a launched process's torch starts with
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized() and not had_group:
            dist.destroy_process_group()
        for sig, handler in handlers.items():
            if signal.getsignal(sig) is not handler:  # (only the main thread may set one)
                signal.signal(sig, handler)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)


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
    one_process = launch.launcher in ONE_PROCESS or launch.nproc == 1  # (`nproc` means nothing to these)
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


def _record(launches: Iterable[Launch]) -> None:
    """Note `launches` under the test module (a `test_*.py` file) found first up this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None and not Path(frame.f_code.co_filename).name.startswith("test_"):
        frame = frame.f_back
    if frame is not None:
        module = _launched.setdefault(frame.f_code.co_filename, set())
        module.update((launch.id, launch.launcher) for launch in launches)


def launched_by(module_file: str) -> set[tuple[str, str]]:
    """The (launch id, launcher) pairs the test module at `module_file` has started so far."""
    return set(_launched.get(str(module_file), set()))


def listed_launches(docstring: str) -> list[tuple[str, str]]:
    """The rows of a module docstring's table whose header starts `launch  launcher`: (id pattern,
    launcher) each. A row starts at the header's indentation; deeper lines continue the row above."""
    rows: list[tuple[str, str]] = []
    indent: int | None = None
    for line in docstring.splitlines():
        words, depth = line.split(), len(line) - len(line.lstrip())
        if words[:2] == ["launch", "launcher"]:
            indent = depth
        elif indent is not None and not words:
            indent = None  # a blank line ends the table
        elif indent is not None and depth == indent:
            rows.append((words[0], words[1] if len(words) > 1 else ""))
    return rows


def unlisted(module_file: str, docstring: str) -> list[str]:
    """The launches of a test module that its docstring's table does not list with their launcher (fnmatch
    patterns allowed in the launch column, for launches named by a loop), as `id (launcher)`."""
    rows = listed_launches(docstring)
    return sorted(
        f"{launch} ({launcher})"
        for launch, launcher in launched_by(module_file)
        if not any(fnmatch.fnmatchcase(launch, pattern) and launcher == ran for pattern, ran in rows)
    )


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
    launchers: dict[str, str] | None = None,
) -> dict[str, RunResult]:
    """Run `launches`; then, for each `name -> resumed_name`, copy run `name` as if it had been stopped right
    after its step-`stopped_at` checkpoint and resume that copy with the same overrides and launcher (or
    `launchers[resumed_name]`: `warm` where the resume, not its launcher, is the property).

    Results of both the straight runs and the resumed copies, by name.
    """
    results = run_launches(launches, config, output_dir)
    by_name = {launch.name: launch for launch in launches}
    again = []
    for name, copy_name in resumed.items():
        copy_as_interrupted(results[name].check().run_dir, output_dir / copy_name, stopped_at, last_step)
        base = by_name[name]
        again.append(
            Launch(
                copy_name,
                (launchers or {}).get(copy_name, base.launcher),
                (*base.overrides, "checkpoint.resume=true"),
                base.nproc,
            )
        )
    results.update(run_launches(again, config, output_dir))
    return results


def preference_pairs_file(path: Path, n: int, seed: int, margin_every: int = 0) -> Path:
    """Pairs with prompts of 1..40 and responses of 1..50 characters: token and pair counts differ a lot
    between micro-batches (what a per-micro-batch mean gets wrong); with `margin_every` k, a reward margin
    of 0.5 on every k-th pair (the first included)."""
    rng = random.Random(seed)

    def text(alphabet: str) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 3, 8, 25, 50])))

    with path.open("w") as f:
        for i in range(n):
            record = {
                "prompt": text("abcdefgh")[:40],
                "chosen": text("0123456789"),
                "rejected": text("xyz!?"),
            }
            margin = {"margin": 0.5} if margin_every and i % margin_every == 0 else {}
            f.write(json.dumps({**record, **margin}) + "\n")
    return path


def metric_rows(result: RunResult, keys: tuple[str, ...]) -> list[list[float]]:
    """The `keys` of every metrics row that has the first of them (a curve of several metrics)."""
    return [[row[k] for k in keys] for row in result.metrics if keys[0] in row]


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest difference between two curves of the same shape."""
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
