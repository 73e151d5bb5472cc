"""The `warm` launcher of tests/launch_helpers.py: a launch's ranks forked from a process that has already
imported what a rank imports, each running the same entry point (`launchers/launch_finetune.py`) with the
environment `torchrun --nproc_per_node N` gives its workers.

A 2-rank launch through a real launcher costs ~20 CPU-s on a 2-core machine, nearly all of it each rank's
imports of torch, transformers, peft and DeepSpeed (and the launcher's own). The suite launches ~125 times;
each property keeps at least one launch through the real launcher it claims (`deepspeed`, `torchrun`,
`python`), and the rest of an equivalence matrix, whose ranks would only import the same modules again, runs
`warm` (the suite stays within its time on 2 cores). Measured on a shared 2-core machine, the same 4-step ZeRO-2 job of tiny-llama on
2 ranks: 15.0 CPU-s under `torchrun`, 21.6 under `deepspeed`, 2.1 warm (after the zygote's ~9 CPU-s of
imports, once per test process); test_engines 265 -> 101 CPU-s, test_equivalence 189 -> 99,
test_grpo_equivalence 187 -> 67.

The zygote is a `multiprocessing` fork server per test process, started on the first warm launch, that
imports `RANK_IMPORTS` (and this module) and nothing else: it runs no torch op and starts no Python thread
(each rank checks), so the ranks forked from it start as a new interpreter would after those imports (OpenMP's thread pool, gloo, DeepSpeed's
accelerator and its JIT ops all start in the rank). Each rank then sets exactly its launch's environment and
torchrun's worker variables, the repository as its working directory and the launch's command line as
`sys.argv`, points its stdout/stderr (file descriptors 1 and 2, so handlers made at import follow) at the
launch's log files, and runs the entry point as `__main__`. Like torchrun, a rank's failure stops the others.

What it is not: a launcher process. Nothing here can be signalled as a launcher (a `Launch.interrupt` is
refused), no agent restarts or reports a failed worker, and rank 0 hosts the rendezvous store that torchrun's
agent would (tests/distributed/test_warm_launch.py shows the environment, metrics and export otherwise
equal to torchrun's). What a launcher itself does (signals, start-up, its own errors) stays with the real ones.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.process
import os
import runpy
import signal
import sys
import threading
from pathlib import Path

# What a rank of a tiny-model launch imports (the entry point's own imports and what the run loads lazily):
# imported once by the zygote, before any rank is forked.
RANK_IMPORTS = (
    "numpy",
    "yaml",
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",  # the built-in families (tiny twins of the same classes)
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.phi3.modeling_phi3",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "peft",
    "bitsandbytes",
    "deepspeed",
    "zerofit.recipe.run",
)
_context: list[multiprocessing.context.ForkServerContext] = []
# In the zygote, which imports this module after `RANK_IMPORTS`: whether any of them started a Python thread
# (whose locks a forked rank would inherit held). Native helper threads some libraries start at import
# (OpenBLAS's pool, jemalloc's background thread) register their own fork handlers.
PYTHON_THREADS_AT_IMPORT = threading.active_count()


def _fork_server() -> multiprocessing.context.ForkServerContext:
    """This process's fork-server context, its zygote preloading `RANK_IMPORTS` (started on first use)."""
    if not _context:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([*RANK_IMPORTS, __name__])
        _context.append(context)
    return _context[0]


def start_zygote() -> None:
    """Start this process's zygote now, if not yet: from the main thread, before `api` launches change this
    process's environment (the zygote imports under the environment it starts with)."""
    import multiprocessing.forkserver

    _fork_server()
    multiprocessing.forkserver.ensure_running()


def torchrun_worker_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """`env` plus what `torchrun --nproc_per_node nproc --master_port port` sets for its worker `rank` on
    one node (its rendezvous, its group and role, and OMP_NUM_THREADS=1 unless given), but for its error
    file (torchrun's agent reads it; zerofit does not write it) and the store, hosted by rank 0."""
    worker = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nproc),
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        # torchrun's agent hosts the rendezvous store (True); here rank 0 does, as under `deepspeed`.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    threads = {} if nproc == 1 or "OMP_NUM_THREADS" in env else {"OMP_NUM_THREADS": "1"}
    return {**env, **threads, **worker}


def _rank_main(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank, in a child of the zygote: the launch's output files, environment, directory and argv,
    then the entry point as `__main__` (it leaves with `os._exit(code)`)."""
    for fd, path in ((1, out), (2, err)):  # first: whatever fails below is in the launch's output
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    assert PYTHON_THREADS_AT_IMPORT == 1, (
        "a module the zygote imports started a Python thread: fork is unsafe"
    )
    missing = [name for name in RANK_IMPORTS if name not in sys.modules]
    assert not missing, f"the zygote did not import {missing}"
    _as_a_new_process(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _as_a_new_process(env: dict[str, str]) -> None:
    """This forked rank's process state as a new interpreter started with `env` would have it."""
    multiprocessing.current_process().name = "MainProcess"  # and no parent process
    multiprocessing.process._parent_process = None
    os.environ.clear()
    os.environ.update(env)
    folders = env.get("PYTHONPATH", "").split(os.pathsep)
    sys.path[:0] = [entry for entry in folders if entry and entry not in sys.path]  # a launch's own first
    if env.get("OMP_NUM_THREADS", "").isdigit():  # what a new process's torch starts with
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class WarmLaunch:
    """A running warm launch: its ranks, polled like a `subprocess.Popen` of a launcher.

    `returncode` is None while a rank runs, then 0 when every rank exited 0, else the first failing rank's
    exit code (a rank killed by a signal: minus the signal). When a rank fails the others are terminated, as
    torchrun's agent does.
    """

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: str | Path, nproc: int
    ):
        from launch_helpers import free_port

        context, port = _fork_server(), free_port()
        for path in (out, err):
            Path(path).write_text("")
        self.ranks = [
            context.Process(
                target=_rank_main,
                args=(argv, torchrun_worker_env(env, rank, nproc, port), str(cwd), str(out), str(err)),
                name=f"warm-rank{rank}",
            )
            for rank in range(nproc)
        ]
        for rank in self.ranks:
            rank.start()
        self.pid = self.ranks[0].pid
        self.returncode: int | None = None
        self.first_failure: int | None = (
            None  # the code of the rank that failed first, before any was stopped
        )

    def poll(self) -> int | None:
        """The launch's exit code once every rank has exited (None before): that of the rank that failed
        first (not a rank this launcher then stopped with SIGTERM), else 0."""
        codes = [rank.exitcode for rank in self.ranks]
        failed = [code for code in codes if code not in (None, 0)]
        if failed and None in codes:
            if self.first_failure is None:
                self.first_failure = failed[0]
            for rank in self.ranks:
                with contextlib.suppress(ProcessLookupError, AttributeError):
                    rank.terminate()
        if None not in codes:
            self.returncode = (self.first_failure or failed[0]) if failed else 0
        return self.returncode

    def kill(self) -> None:
        for rank in self.ranks:
            with contextlib.suppress(ProcessLookupError, AttributeError):
                rank.kill()

    def wait(self) -> int:
        for rank in self.ranks:
            rank.join()
        code = self.poll()
        assert code is not None
        return code
