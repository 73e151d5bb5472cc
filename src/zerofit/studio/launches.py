"""Launches from the page: only zerofit's own launcher, with a validated config written into the run folder
first, one queue per machine.

A launch plans the form with `zerofit plan`'s code (`planning.plan_form`); a user error stops it there, as the
terminal's launch would stop. The plan's run folder (a new run takes a free name, `-2` beside a taken one) gets
the resolved config as `config.yaml`, created exclusively: a second tab launching into the same folder finds
it taken and is refused, so two runs never write one folder. The job is then
`launchers/launch_finetune.py --config RUN/config.yaml checkpoint.resume=auto` (resume: `=true`) under
`python` for one rank or `torch.distributed.run` for several, in the workspace, in a session of its own. Jobs
run one at a time per machine: the queue's worker holds an `flock` under zerofit's cache root while its job
runs, so a second studio on the machine waits its turn. Stop sends SIGINT to the job's process group, what
Ctrl-C in the terminal sends: the run saves a checkpoint and exits.
"""

from __future__ import annotations

import fcntl
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zerofit.core.cache_dirs import cache_root
from zerofit.core.errors import LaunchError
from zerofit.core.run_layout import CONFIG_FILE
from zerofit.studio.security import Workspace

QUEUE_LOCK = "studio-queue.lock"  # under zerofit's cache root: one queue per machine
LOG_DIR = ".zerofit-studio"  # under the workspace: each job's output, as the terminal would have shown it
LAUNCH_ENV_DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_script(workspace: Workspace) -> Path:
    """zerofit's launcher: the checkout's `launchers/launch_finetune.py`, else the workspace's."""
    for root in (Path(__file__).resolve().parents[3], workspace.root):
        script = root / "launchers" / "launch_finetune.py"
        if script.is_file():
            return script
    raise LaunchError(
        "zerofit studio launches runs with launchers/launch_finetune.py, found neither beside the zerofit "
        f"package nor in the workspace {workspace.root}; start the studio in a zerofit checkout "
        "(`zerofit studio --workspace PATH/TO/zerofit`)"
    )


def launch_prefix(world_size: int) -> list[str]:
    """The process launcher for `world_size` ranks: this Python for one, torchrun's module for several."""
    if world_size == 1:
        return [sys.executable]
    with socket.socket() as s:  # a free rendezvous port (29500 may be another run's)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world_size}",
        f"--master_port={port}",
    ]


@dataclass
class Job:
    """One launch: its run folder, command and state (queued, running, stopping, done, failed, cancelled)."""

    id: int
    run_dir: Path
    argv: list[str]
    world_size: int
    log: Path
    state: str = "queued"
    pid: int | None = None
    returncode: int | None = None
    started: float | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def as_dict(self, workspace: Workspace) -> dict[str, Any]:
        """What the page shows of the job."""
        return {
            "id": self.id,
            "run": workspace.relative(self.run_dir),
            "state": self.state,
            "pid": self.pid,
            "returncode": self.returncode,
            "world_size": self.world_size,
            "devices": devices(self.world_size),
            "command": " ".join(self.argv),
            "log": workspace.relative(self.log),
        }


def devices(world_size: int) -> str:
    """The devices a job's ranks use, in words (CUDA_VISIBLE_DEVICES where set)."""
    from zerofit.commands.plan import default_device

    if default_device() == "cpu":
        return f"{world_size} CPU rank(s) (no GPU here)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",")[:world_size] if visible else [str(i) for i in range(world_size)]
    return f"GPU {', '.join(ids)}"


def write_run_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """The validated config as the run folder's `config.yaml`, created exclusively (a folder another launch
    took is refused); the run name is the folder's, so the launch writes there and nowhere else."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {**config, "run_name": run_dir.name, "output_dir": str(run_dir.parent)}
    data["checkpoint"] = {**data.get("checkpoint", {}), "resume": "auto"}
    path = run_dir / CONFIG_FILE
    try:
        with path.open("x", encoding="utf-8") as f:
            yaml.safe_dump(data, f, sort_keys=False)
    except FileExistsError:
        raise LaunchError(
            f"run folder {run_dir} was taken by another launch (another tab or terminal) a moment ago: two runs "
            "never write one folder; plan again for a free name, or open that run to watch it"
        ) from None
    return path


class LaunchQueue:
    """This studio's jobs, run one at a time per machine by one worker thread."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.jobs: dict[int, Job] = {}
        self._pending: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._work, name="zerofit-studio-queue", daemon=True).start()

    def submit(self, run_dir: Path, world_size: int, resume: bool) -> Job:
        """Queue the launch of `run_dir/config.yaml` (resume: `checkpoint.resume=true`)."""
        with self._lock:
            busy = [
                j for j in self.jobs.values() if j.run_dir == run_dir and j.state in ("queued", "running")
            ]
            if busy:
                raise LaunchError(
                    f"run folder {run_dir} already has a {busy[0].state} launch (job {busy[0].id}): two runs "
                    "never write one folder; stop it first, or wait for it to end"
                )
            script = launcher_script(self.workspace)
            argv = [*launch_prefix(world_size), str(script), "--config", str(run_dir / CONFIG_FILE)]
            argv.append(f"checkpoint.resume={'true' if resume else 'auto'}")
            job_id = len(self.jobs) + 1
            log = self.workspace.root / LOG_DIR / f"job-{job_id}-{run_dir.name}.log"
            job = Job(job_id, run_dir, argv, world_size, log)
            self.jobs[job_id] = job
        self._pending.put(job)
        return job

    def stop(self, job_id: int) -> Job:
        """Stop a job as Ctrl-C would (SIGINT to its process group: a checkpoint, then exit); a queued one is
        cancelled."""
        job = self.jobs.get(job_id)
        if job is None:
            raise LaunchError(f"job {job_id} is not one of this studio's launches; reload the page")
        with self._lock:
            if job.state == "queued":
                job.state = "cancelled"
            elif job.state == "running" and job.pid is not None:
                os.killpg(job.pid, signal.SIGINT)
                job.state = "stopping"
        return job

    def job_of(self, run_dir: Path) -> Job | None:
        """The newest job of `run_dir`, if this studio launched it."""
        return next((j for j in reversed(self.jobs.values()) if j.run_dir == run_dir), None)

    def _work(self) -> None:
        """The worker: each queued job in turn, under the machine's queue lock."""
        while True:
            job = self._pending.get()
            if job.state == "cancelled":
                continue
            lock_file = cache_root() / QUEUE_LOCK
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            with lock_file.open("a") as held:
                fcntl.flock(held, fcntl.LOCK_EX)  # another studio's job first, if one runs
                self._run(job)

    def _run(self, job: Job) -> None:
        """Start `job` in the workspace, in a session of its own, and wait for it."""
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_DROPPED}
        job.log.parent.mkdir(parents=True, exist_ok=True)
        with job.log.open("ab") as out, self._lock:
            if job.state == "cancelled":
                return
            job.process = subprocess.Popen(
                job.argv,
                cwd=self.workspace.root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            job.pid, job.state, job.started = job.process.pid, "running", time.time()
        code = job.process.wait()
        with self._lock:
            job.returncode = code
            job.state = "stopped" if job.state == "stopping" else ("done" if code == 0 else "failed")
