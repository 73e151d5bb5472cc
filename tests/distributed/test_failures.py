"""Failures a long run meets end cleanly on every rank (real 2-rank launches, gloo on CPU):

- a full disk mid-checkpoint (a real tmpfs; ZeRO-2 under `deepspeed`, FSDP2 under `torchrun`, W&B offline):
  one paragraph on every rank (folder, free space, what was kept, the fix), no traceback (W&B's logging
  included), the partial folder removed, and no rank left waiting in a barrier;
- the `deepspeed` runner killed alone: its `launch.py` and both ranks stop instead of training on unwatched;
- one rank killed (`kill -9`) mid-run: the other says which rank stopped, the last complete checkpoint and the
  resume command in one paragraph, instead of gloo's "Connection reset by peer" traceback;
- long rank-0-only work outlasts the process-group timeout without killing the run; timed saves agree;
- an `rl.environment` that raises on one rank only (GRPO, its step on rank 1): every rank stops at that step
  with the one paragraph, said once (rank 0, which learns it from the rollout's agreement), exit code 2;
- an `rl.tools` module that fails to import on one rank only (GRPO, at launch): every rank stops before the
  run's files with the one config paragraph, said once (rank 0, from the agreement on the built agent), exit
  code 2.

The last two launches' ranks are warm (tests/warm_launch.py): what they show is zerofit's agreement, not a
launcher's (a user error's exit 2 and one paragraph through the `deepspeed` runner is test_launch_errors'
indivisible-2-ranks).

The slow-rank-0 launch is one 2-rank DDP launch (torchrun, gloo) with `distributed.timeout_minutes` = 0.2 (12 s): rank 0's
data loading is delayed 20 s, as a long tokenization would be (tests/slow_rank0_data/sitecustomize.py, first
on the ranks' PYTHONPATH, wraps zerofit's rank-0 data load with the sleep; zerofit itself has no such hook). Rank 1 waits for it through the c10d store (`Strategy.wait_for_rank0`); waiting
inside the broadcast that follows, as before, gloo aborts after 12 s ("Timed out waiting ... for recv").
(The delay exceeds the timeout by 8 s, more than the two ranks' start-up can differ by; both are short
because the delay is idle time: it runs beside the full-disk launches, which use the two cores meanwhile.)
The same launch saves on a wall-clock interval (`checkpoint.every_minutes` of a fraction of a second):
only rank 0's clock decides, through the loop's after-step all-reduce, so both ranks enter the same
collective saves and the run finishes with several timed checkpoints.

    launch       launcher    engine             what
    slow-rank0   torchrun    DDP                rank 0's data load delayed past the process-group timeout
    zero2        deepspeed   DeepSpeed ZeRO-2   a full disk mid-checkpoint, W&B offline
    fsdp         torchrun    FSDP2              a full disk mid-checkpoint
    orphan       deepspeed   DeepSpeed ZeRO-2   the `deepspeed` runner killed alone
    lost         deepspeed   DeepSpeed ZeRO-2   one rank killed mid-run
    env-fails    warm        DeepSpeed ZeRO-2   an environment raising in step on rank 1 only (GRPO)
    tools-fail   warm        DDP                a tool module failing to import on rank 1 only (GRPO)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import Popen

import psutil
import pytest

from full_disk import small_filesystem
from launch_helpers import REPO, Launch, RunResult, run_launches, write_config
from slow_rank0_data import sitecustomize as slow_rank0_data
from zerofit.checkpoint import complete_checkpoints

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_MINUTES, DELAY_S, STEPS = 0.2, 20, 6


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("failures")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i} ", "response": f"a{i}"}) + "\n" for i in range(32)))
    return write_config(
        root / "job.yaml",
        {
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "distributed": {"strategy": "deepspeed", "preset": "zero2"},
            "train": {"max_steps": 6, "precision": "fp32"},
            "lora": {"enabled": True, "r": 8, "alpha": 16},
            "data": {"path": str(data), "max_seq_len": 32},
            "checkpoint": {"every_steps": 2},
            "logging": {"console": False, "wandb": {"mode": "offline"}},
        },
    )


# Each engine writes its checkpoint its own way: DeepSpeed's checkpoint engine (its barriers around every
# rank's files), DCP (which gathers every rank's outcome itself).
ENGINES = {
    "zero2": ("deepspeed", ("distributed.strategy=deepspeed", "distributed.preset=zero2")),
    "fsdp": ("torchrun", ("distributed.strategy=fsdp",)),
}


@pytest.fixture(scope="module")
def slow_rank0(config: Path) -> Launch:
    """The slow-rank-0 DDP launch with its own job: a 12 s timeout, rank 0's data 20 s late, timed saves."""
    job = write_config(
        config.parent / "timeouts.yaml",
        {
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "distributed": {"strategy": "ddp", "timeout_minutes": TIMEOUT_MINUTES},
            "train": {"max_steps": STEPS, "precision": "fp32"},
            "data": {"path": "data/demo.jsonl", "max_seq_len": 64},
            "checkpoint": {"every_minutes": 0.001, "keep_last": STEPS},  # due after 0.06 s: most steps
            "logging": {"wandb": {"mode": "disabled"}},
        },
    )
    hook = Path(slow_rank0_data.__file__).parent  # its sitecustomize, ahead of the suite's own PYTHONPATH
    pythonpath = os.pathsep.join(filter(None, (str(hook), os.environ.get("PYTHONPATH"))))
    env = {slow_rank0_data.DELAY_ENV: str(DELAY_S), "PYTHONPATH": pythonpath}
    return Launch("slow-rank0", "torchrun", env=env, config=job)


ENV_MODULE = "zerofit_planted_rank1_env"  # a user environment, importable only from its job's folder
RANK1_ENV = """
import os


class FailsOnRank1:
    def reset(self, row, seed):
        return []

    def step(self, text):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("rank 1's board is gone")
        return [], 0.0, True
"""


@pytest.fixture(scope="module")
def env_fails(config: Path) -> Launch:
    """A GRPO job on 2 ranks whose environment's step raises on rank 1 only (it reads RANK): rank 0's own
    trajectories are fine, so it can only learn of the failure from the agreement."""
    root = config.parent / "env"
    root.mkdir()
    (root / f"{ENV_MODULE}.py").write_text(RANK1_ENV)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8)))
    job = write_config(
        root / "agent.yaml",
        {
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": None, "micro_batch_size": 1},
            "distributed": {"strategy": "deepspeed", "preset": "zero2"},
            "train": {"objective": "grpo", "max_steps": 2, "precision": "fp32"},
            "rl": {
                "num_generations": 2,
                "prompts_per_step": 2,
                "max_completion_length": 8,
                "max_turns": 1,
                "environment": f"{ENV_MODULE}:FailsOnRank1",
            },
            "data": {"path": str(root / "prompts.jsonl")},
            "checkpoint": {"every_steps": 0},
            "logging": {"wandb": {"mode": "disabled"}},
        },
    )
    pythonpath = os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
    return Launch("env-fails", "warm", env={"PYTHONPATH": pythonpath}, config=job)


TOOLS_MODULE = "zerofit_planted_rank1_tools"  # a user tool module, importable only from its job's folder
RANK1_TOOLS = """
import os

if os.environ.get("RANK") == "1":
    raise OSError("rank 1 cannot reach the tool server")


def add(a: int, b: int) -> str:
    \"\"\"Add two numbers.

    Args:
        a: the first
        b: the second
    \"\"\"
    return str(a + b)
"""


@pytest.fixture(scope="module")
def tools_fail(config: Path, env_fails: Launch) -> Launch:
    """The environment job's prompts on DDP with a tool whose module raises at import on rank 1 only: rank 0
    builds its agent, so it can only learn of the failure from the agreement."""
    root = config.parent / "tools"
    root.mkdir()
    (root / f"{TOOLS_MODULE}.py").write_text(RANK1_TOOLS)
    job = write_config(
        root / "tools.yaml",
        {
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": None, "micro_batch_size": 1},
            "distributed": {"strategy": "ddp"},
            "train": {"objective": "grpo", "max_steps": 2, "precision": "fp32"},
            "rl": {
                "num_generations": 2,
                "prompts_per_step": 2,
                "max_completion_length": 16,
                "max_turns": 2,
                "max_prompt_length": 1024,  # the tools' schemas in the system turn (tiny-llama's fallback)
                "tools": [{"function": f"{TOOLS_MODULE}:add"}],
                "environment": "zerofit.demo.environments:DigitsTwice",
            },
            "data": {"path": str(config.parent / "env" / "prompts.jsonl")},
            "checkpoint": {"every_steps": 0},
            "logging": {"wandb": {"mode": "disabled"}},
        },
    )
    pythonpath = os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
    return Launch("tools-fail", "warm", env={"PYTHONPATH": pythonpath}, config=job)


FullDisk = dict[str, tuple[RunResult, Path, list[str]]]
SideBySide = tuple[FullDisk | str, RunResult, RunResult, RunResult]


@pytest.fixture(scope="module")
def side_by_side(config: Path, slow_rank0: Launch, env_fails: Launch, tools_fail: Launch) -> SideBySide:
    """The slow-rank-0 launch first (its ranks idle through the delay), the environment's and the tools'
    failures, and both engines' full-disk launches, each with its output_dir on its own 400 KiB filesystem:
    it holds the run's small files but not a checkpoint (~650 KiB on ZeRO-2 here). Where no filesystem can
    be mounted, the reason instead of the full-disk results."""
    with contextlib.ExitStack() as mounts:
        try:
            disks = {
                name: mounts.enter_context(small_filesystem(config.parent / name, 400)) for name in ENGINES
            }
        except pytest.skip.Exception as skipped:
            disks, reason = {}, str(skipped)
        launches = [slow_rank0, env_fails, tools_fail] + [
            Launch(name, launcher, (*overrides, f"output_dir={disks[name]}"))
            for name, (launcher, overrides) in ENGINES.items()
            if disks
        ]
        results = run_launches(launches, config, config.parent / "runs", timeout=300)
        if not disks:
            return reason, results[slow_rank0.id], results[env_fails.id], results[tools_fail.id]
        # (result, run dir, what its checkpoints/ holds), read before the small disks are unmounted
        full = {
            name: (
                results[name],
                disks[name] / name,
                sorted(p.name for p in (disks[name] / name / "checkpoints").iterdir()),
            )
            for name in ENGINES
        }
        return full, results[slow_rank0.id], results[env_fails.id], results[tools_fail.id]


@pytest.fixture(scope="module")
def full_disk_runs(side_by_side: SideBySide) -> FullDisk:
    full = side_by_side[0]
    if isinstance(full, str):
        pytest.skip(full)
    return full


@pytest.fixture(scope="module")
def run(side_by_side: SideBySide) -> RunResult:
    return side_by_side[1]


def test_an_environment_failing_on_one_rank_stops_every_rank_with_one_paragraph(
    side_by_side: SideBySide,
) -> None:
    said = _said_once(side_by_side[2], "error: The environment")
    assert said.startswith(
        f"zerofit (rank 0): error: The environment {ENV_MODULE}:FailsOnRank1 failed in step() on the rollout "
        "of step 1, data record "
    ), said
    assert "turn 1: it raised RuntimeError: rank 1's board is gone; an environment is your code" in said
    assert said.endswith(
        "No checkpoint was saved yet (nothing of step 1 was): once fixed, start the run again"
    )


def test_a_tool_module_failing_on_one_rank_stops_every_rank_with_one_paragraph(
    side_by_side: SideBySide,
) -> None:
    result = side_by_side[3]
    assert _said_once(result, "error: Invalid configuration") == (  # by rank 0, though only rank 1 failed
        f"zerofit (rank 0): error: Invalid configuration: rl.tools[0].function = '{TOOLS_MODULE}:add': "
        f"importing module '{TOOLS_MODULE}' raised OSError: rank 1 cannot reach the tool server; fix the module"
    )
    assert not (result.run_dir / "config.yaml").exists()  # refused before the run's files


def _said_once(result: RunResult, marker: str) -> str:
    """The one line of a 2-rank launch's output holding `marker`: a user error stops every rank with exit code
    2 and is said once per run (not once per rank), with no traceback."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    said = [line for line in out.splitlines() if marker in line]
    assert len(said) == 1, out[-3000:]
    return said[0]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_full_disk_mid_checkpoint_is_one_paragraph_on_every_rank(
    full_disk_runs: FullDisk, engine: str
) -> None:
    result, run_dir, leftovers = full_disk_runs[engine]
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    for rank in (0, 1):
        paragraph = f"zerofit (rank {rank}): error: checkpoint step-2 could not be written in {run_dir}"
        assert paragraph in out, out[-3000:]
    assert "No space left on device" in out or "could not write" in out
    assert "free of 400.0 KiB" in out
    assert "Kept: no checkpoint" in out and "the partial step-2.tmp was removed" in out
    # No traceback through zerofit's code or W&B's logging (torchrun prints one of its own for any exit 2).
    assert f'File "{REPO / "src"}' not in out and "Logging error" not in out, out[-3000:]
    if engine == "zero2":
        assert "Traceback" not in out, out[-3000:]
    assert leftovers == []


@contextlib.contextmanager
def _deepspeed_launch(
    config: Path, out: Path, name: str, overrides: tuple[str, ...]
) -> Iterator[Popen[bytes]]:
    """`deepspeed --num_gpus 2 launchers/launch_finetune.py ...` started as a user would (its own session),
    its stdout and stderr in `out/name.out` and `out/name.err`; whatever is left of it is killed after."""
    cmd = Launch(name, "deepspeed", overrides).command(config, out)
    own = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")  # the launch brings its own rendezvous
    env = {k: v for k, v in os.environ.items() if k not in own}
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{name}.out").open("w") as stdout, (out / f"{name}.err").open("w") as stderr:
        runner = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    try:
        yield runner
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)  # whatever a failed check left of the launch


def _wait_until(done: Callable[[], bool], runner: Popen[bytes], log: Path) -> None:
    """Wait until `done()` while the launch runs (a bound on the wait, not a speed requirement)."""
    deadline = time.monotonic() + 300
    while not done():
        assert runner.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def _rank_processes(runner: Popen[bytes]) -> dict[int, psutil.Process]:
    """The launch's rank processes by local rank (deepspeed's launch.py passes `--local_rank=R`)."""
    ranks = {}
    for proc in psutil.Process(runner.pid).children(recursive=True):
        flags = [part for part in proc.cmdline() if part.startswith("--local_rank=")]
        if flags:
            ranks[int(flags[0].split("=")[1])] = proc
    return ranks


def test_killing_the_deepspeed_runner_alone_ends_launch_py_and_every_rank(
    config: Path, tmp_path: Path
) -> None:
    """Only the runner's pid is killed (not its process group): launch.py and the ranks are its descendants,
    not its children, so without a watch they train on (and would race a resume with their checkpoints)."""
    steps = 100_000  # far more than the wait below could train: on main the ranks are still training
    out = tmp_path / "runs"
    overrides = (f"train.max_steps={steps}", "checkpoint.every_steps=0")
    with _deepspeed_launch(config, out, "orphan", overrides) as runner:
        metrics, log = out / "orphan" / "metrics.jsonl", out / "orphan.err"
        _wait_until(lambda: metrics.is_file() and bool(metrics.read_text().strip()), runner, log)
        descendants = psutil.Process(runner.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in descendants]
        assert sum("deepspeed.launcher.launch" in c for c in commands) == 1, commands
        assert sorted(_rank_processes(runner)) == [0, 1], commands
        os.kill(runner.pid, signal.SIGKILL)  # the runner only, as `kill -9 PID` does
        runner.wait()
        _, alive = psutil.wait_procs(descendants, timeout=60)  # a bound on the wait, not a speed requirement
        left = [" ".join(p.cmdline()) for p in alive if p.is_running()]
        assert not left, f"still running after the deepspeed runner was killed: {left}"
        assert len(metrics.read_text().splitlines()) < steps
        assert "the deepspeed launcher" in log.read_text()


def test_a_rank_killed_mid_run_leaves_the_other_with_one_paragraph_and_the_resume_command(
    config: Path, tmp_path: Path
) -> None:
    """`kill -9` of rank 1 once a checkpoint is saved: rank 0's next collective fails (gloo: "Connection reset
    by peer"), and instead of that traceback it says which rank stopped, the last complete checkpoint and the
    resume command, in one paragraph on stderr (its exit code is 75; deepspeed's own is the killed rank's)."""
    out = tmp_path / "runs"
    overrides = ("train.max_steps=100000", "checkpoint.every_steps=2", "logging.wandb.mode=disabled")
    with _deepspeed_launch(config, out, "lost", overrides) as runner:
        run_dir, err = out / "lost", out / "lost.err"
        _wait_until(lambda: bool(complete_checkpoints(run_dir)), runner, err)
        ranks = _rank_processes(runner)
        victim = ranks[1].pid
        os.kill(victim, signal.SIGKILL)
        assert runner.wait(timeout=120) != 0  # a bound on the wait, not a speed requirement
    text, shown = err.read_text(), (out / "lost.out").read_text()
    assert "Traceback" not in text + shown, text[-4000:]
    (paragraph,) = [line for line in text.splitlines() if line.startswith("zerofit (rank 0): error: ")]
    step, folder = complete_checkpoints(run_dir)[-1]
    assert paragraph.startswith(f"zerofit (rank 0): error: rank 1 (pid {victim}) stopped (killed, "), (
        paragraph
    )
    assert f"The last complete checkpoint is {folder} (step {step})" in paragraph
    assert paragraph.endswith("resume with the same command plus checkpoint.resume=true")
    assert "zerofit (rank 1)" not in text  # the killed rank says nothing


def test_a_rank_0_job_longer_than_the_timeout_does_not_kill_the_run(run: RunResult) -> None:
    run.check()
    assert f"collectives wait {TIMEOUT_MINUTES:g} min for a peer (distributed.timeout_minutes)" in run.stdout
    assert run.seconds > DELAY_S and len(run.metrics) == STEPS


def test_timed_saves_are_taken_by_every_rank_at_the_same_steps(run: RunResult) -> None:
    run.check()
    steps = [step for step, _ in complete_checkpoints(run.run_dir)]
    assert steps[-1] == STEPS and len(steps) >= 3, steps  # timed saves besides the final one
    for step in steps:  # both ranks wrote their part of every one (a disagreement would hang the save)
        assert {p.name for p in (run.run_dir / "checkpoints" / f"step-{step}").glob("rng-rank*.pt")} == {
            "rng-rank0.pt",
            "rng-rank1.pt",
        }
