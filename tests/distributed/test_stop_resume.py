"""Runs never lose work and never resume wrongly: real launches (python, deepspeed, torchrun; gloo on CPU).

Four interrupted runs ("chains") of one fp32 LoRA job (no dropout, so every split computes the same
losses), each stopped by SIGTERM and by SIGINT mid-run and resumed with `checkpoint.resume=true`, some on
another world size, plus an uninterrupted reference run (through the Python API, in the test process).
Launches of one round run side by side:

    launch          launcher   segments (chain-N is segment N): ranks and how each one ends
    reference       api        1 end: the uninterrupted run
    single-*        python     1 SIGTERM -> 1 Ctrl-C -> (1 end)                W&B offline: one run id throughout
    zero2-*         deepspeed  2 SIGTERM -> 2 Ctrl-C -> 1 SIGTERM -> (2 end)   elastic 2 -> 1 and 1 -> 2
    zero3-*         torchrun   1 SIGTERM -> 2 Ctrl-C -> (1 end)                elastic 1 -> 2 and 2 -> 1
    fsdp-*          torchrun   2 SIGTERM -> 2 Ctrl-C -> (2 end)                TensorBoard + MLflow: one run each
    single-3        warm       (end) each chain's last segment: resumed, trains to the end
    zero2-4         warm       (end)
    zero3-3         warm       (end)
    fsdp-3          warm       (end)
    fsdp-fallback   warm       1 end: the fsdp chain's newest checkpoint damaged, resumed from the one
                               before (and resharded 2 -> 1)
    retuned         warm       2 end: a copy of the zero3 chain resumed with a new lr and 4 more steps
    refused         warm       the single chain resumed with a changed lr: refused before any model load

Launches whose launcher is not what they test run `warm` (tests/warm_launch.py): each chain's last
segment, which only resumes and trains to the end (every chain's resume through its real launcher is its
signalled middle segments, each resumed and then stopped there), and the last round's three launches (the
refusal is zerofit's resume check; a user error through the `python` launcher is test_launch_errors').
SIGTERM goes to the launcher process (`kill PID`), except under `deepspeed`, whose runner neither handles
nor forwards it, and on the zero3 chain: there it goes to the process group, as schedulers send it
(torchrun starts its workers in their own sessions: it reaches them through torchrun). Ctrl-C is SIGINT to
the process group, as a terminal sends it. A last launch resumes the single chain with a changed learning rate and must
be refused before any model is loaded. Every chain's per-step losses equal the reference's within 1e-5. The fsdp chain (and its fallback) also logs to TensorBoard and MLflow
(the default store, sqlite under output_dir): after two stops and a resume from an older checkpoint, each holds
one run with every step once, read back with TensorBoard's reader and MLflow's client.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_helpers import (
    LAUNCHER,
    REPO,
    Launch,
    RunResult,
    deepspeed_shm_segments,
    free_port,
    run_launches,
    varied_length_data,
    write_config,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 16
TERM, INT = signal.SIGTERM, signal.SIGINT
RESUME = "checkpoint.resume=true"
Z2, Z3, FSDP = (
    ("distributed.strategy=deepspeed", "distributed.preset=zero2"),
    (
        "distributed.strategy=deepspeed",
        "distributed.preset=zero3",
    ),
    ("distributed.strategy=fsdp", "logging.tensorboard=true", "logging.mlflow.enabled=true"),
)
SINGLE = ("distributed.strategy=single", "logging.wandb.mode=offline")
# chain -> [(launcher, ranks, overrides, how the segment ends: (signal, target) or None = runs to the end)]
CHAINS: dict[str, list[tuple[str, int, tuple[str, ...], tuple[int, str] | None]]] = {
    "single": [
        ("python", 1, SINGLE, (TERM, "launcher")),
        ("python", 1, SINGLE, (INT, "group")),
        ("warm", 1, SINGLE, None),
    ],
    "zero2": [
        ("deepspeed", 2, Z2, (TERM, "group")),
        ("deepspeed", 2, Z2, (INT, "group")),
        ("deepspeed", 1, Z2, (TERM, "group")),
        ("warm", 2, Z2, None),
    ],
    "zero3": [  # DeepSpeed under torchrun (the zero2 chain is the deepspeed runner's)
        ("torchrun", 1, Z3, (TERM, "group")),
        ("torchrun", 2, Z3, (INT, "group")),
        ("warm", 1, Z3, None),
    ],
    "fsdp": [
        ("torchrun", 2, FSDP, (TERM, "launcher")),
        ("torchrun", 2, FSDP, (INT, "group")),
        ("warm", 2, FSDP, None),
    ],
}
SEGMENTS = [(chain, i) for chain, segs in CHAINS.items() for i in range(len(segs))]
STOPPED = [(chain, i) for chain, i in SEGMENTS if CHAINS[chain][i][3] is not None]


def _key(chain: str, i: int) -> str:
    return f"{chain}-{i + 1}"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stop-resume")
    data = varied_length_data(root / "data.jsonl", 48, seed=5)
    return write_config(
        root / "job.yaml",
        {
            "seed": 3,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "train": {"max_steps": STEPS, "precision": "fp32"},
            "optimizer": {"lr": 1e-2},
            "scheduler": {"name": "cosine", "warmup_steps": 2},  # the schedule's position must resume too
            "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0},
            "data": {"path": str(data), "max_seq_len": 64},
            "checkpoint": {"every_steps": 0, "keep_last": 2},  # only stops and the end save
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )


# The single chain's run directory just before the refused launch (the refusal must not touch it).
BEFORE_REFUSAL: dict[str, tuple[int, int]] = {}


@pytest.fixture(scope="module")
def runs(config: Path, shm_before: set[Path]) -> dict[str, RunResult]:
    out = config.parent / "runs"
    results: dict[str, RunResult] = {}
    rounds = max(len(segs) for segs in CHAINS.values())
    for i in range(rounds):
        # The uninterrupted reference runs in this process (`api`): one process start fewer, same run.
        launches = [Launch("reference", "api", SINGLE[:1])] if i == 0 else []
        for chain, segs in CHAINS.items():
            if i < len(segs):
                launcher, nproc, overrides, ends = segs[i]
                interrupt = (ends[0], ends[1], 1) if ends else None  # once one more step is logged
                overrides = (*overrides, RESUME) if i else overrides
                launches.append(
                    Launch(chain, launcher, overrides, nproc, _key(chain, i), interrupt=interrupt)
                )
        if i == rounds - 1:
            launches += _last_round(out)
        results.update(run_launches(launches, config, out, max_parallel=2))
    return results


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


RETUNED_LR, RETUNED_STEPS = 5e-3, STEPS + 4


def _last_round(out: Path) -> list[Launch]:
    """The fsdp chain's newest checkpoint damaged, resumed on 1 rank; the single chain resumed with a new lr
    (refused); a copy of the finished zero3 chain resumed on 2 ranks with a new lr and 4 more steps, accepted."""
    newest = max((out / "fsdp" / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    os.truncate(newest / "dcp" / "__0_0.distcp", 1000)
    BEFORE_REFUSAL.update(_snapshot(out / "single"))
    cache = {"ZEROFIT_CACHE": str(out.parent / "cache-refusal")}  # must stay empty: no model load
    shutil.copytree(out / "zero3", out / "zero3-retuned")  # the zero3 chain's own results stay as they were
    accepted = (
        f"optimizer.lr={RETUNED_LR}",
        f"train.max_steps={RETUNED_STEPS}",
        "checkpoint.allow_changes=[optimizer.lr,train.max_steps]",
    )
    return [
        Launch("zero3-retuned", "warm", (*Z3, RESUME, *accepted), 2, "retuned"),
        Launch("fsdp", "warm", (*FSDP, RESUME), 1, "fsdp-fallback"),
        Launch("single", "warm", (*SINGLE, RESUME, "optimizer.lr=0.02"), 1, "refused", cache),
    ]


def _stop_line(run: RunResult) -> re.Match[str] | None:
    return re.search(
        r"zerofit: stopped by (SIG\w+) after step (\d+) of (\d+); checkpoint (\S+); ", run.stdout
    )


def _zerofit_tracebacks(run: RunResult) -> list[str]:
    """Tracebacks in a launch's output other than the launcher's own (torchrun re-raises the signal as a
    SignalException; DeepSpeed's runner dies of Ctrl-C with a KeyboardInterrupt): none may come from a rank."""
    text = run.stdout + run.stderr
    blocks = re.findall(r"Traceback \(most recent call last\):\n(?:  .*\n)+\S.*", text)
    launchers = ("torch/distributed/run.py", "deepspeed/launcher/runner.py")
    return [b for b in blocks if not any(name in b for name in launchers) or "launch_finetune" in b]


@pytest.mark.parametrize(("chain", "i"), STOPPED, ids=[_key(c, i) for c, i in STOPPED])
def test_a_signal_stops_after_a_step_saves_and_says_how_to_resume(
    runs: dict[str, RunResult], chain: str, i: int
) -> None:
    run, sig = runs[_key(chain, i)], CHAINS[chain][i][3][0]  # type: ignore[index]
    stop = _stop_line(run)
    assert stop, run.stdout[-3000:] + run.stderr[-3000:]
    assert stop.group(1) == sig.name and int(stop.group(3)) == STEPS
    assert run.stdout.count("zerofit: stopped by") == 1  # one line, from rank 0
    assert f"resume with the same command plus {RESUME}" in run.stdout
    assert not _zerofit_tracebacks(run), _zerofit_tracebacks(run)
    if CHAINS[chain][i][0] == "python":
        assert run.returncode == 128 + sig
    else:  # the launcher reports the failure its own way; the ranks exited with 128 + the signal
        assert run.returncode != 0
    # The next launch resumes exactly there.
    step = int(stop.group(2))
    assert 0 < step < STEPS
    assert f"resumed from {stop.group(4)} at step {step} of {STEPS}" in runs[_key(chain, i + 1)].stdout


@pytest.mark.parametrize("chain", list(CHAINS))
def test_an_interrupted_and_resumed_run_has_the_uninterrupted_losses(
    runs: dict[str, RunResult], chain: str
) -> None:
    final = runs[_key(chain, len(CHAINS[chain]) - 1)]
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    assert not _zerofit_tracebacks(final)
    reference = runs["reference"].check()
    assert [row["step"] for row in final.metrics] == list(range(1, STEPS + 1))  # one row per step
    a, b = reference.series("loss"), final.series("loss")
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    assert final.series("lr") == pytest.approx(reference.series("lr"), rel=1e-12)


@pytest.mark.parametrize(("chain", "ranks"), [("zero2", [2, 2, 1, 2]), ("zero3", [1, 2, 1])])
def test_elastic_resume_keeps_the_global_batch_on_another_world_size(
    runs: dict[str, RunResult], chain: str, ranks: list[int]
) -> None:
    final = runs[_key(chain, len(ranks) - 1)]
    dp = final.series("dp_size")
    assert sorted(set(dp)) == sorted(set(ranks)) and dp[0] == ranks[0] and dp[-1] == ranks[-1]
    for row in final.metrics:
        assert row["micro_batch_size"] * row["grad_accum_steps"] * row["dp_size"] == 8
    for i in range(1, len(ranks)):
        out = runs[_key(chain, i)].stdout
        if ranks[i] != ranks[i - 1]:
            assert f"elastic resume: saved on {ranks[i - 1]} rank(s), resuming on {ranks[i]}" in out, out[
                -2000:
            ]


def test_a_damaged_checkpoint_falls_back_to_the_newest_that_verifies(runs: dict[str, RunResult]) -> None:
    run = runs["fsdp-fallback"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not _zerofit_tracebacks(run) and "EOFError" not in run.stdout + run.stderr
    match = re.search(
        rf"step-{STEPS} is damaged \(dcp/__0_0.distcp is 1,000 bytes, the manifest says [\d,]+\): resuming from "
        r"step-(\d+), the newest checkpoint that verifies",
        run.stdout,
    )
    assert match, run.stdout[-3000:]
    assert "elastic resume: saved on 2 rank(s), resuming on 1" in run.stdout
    assert (run.run_dir / "checkpoints" / f"step-{STEPS}.damaged").is_dir()
    # The resumed steps again match the uninterrupted run; metrics.jsonl was rewound to the fallback step.
    rows = run.metrics
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    a, b = runs["reference"].series("loss"), run.series("loss")
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_a_trajectory_changing_resume_is_refused_before_any_model_load(
    runs: dict[str, RunResult], config: Path
) -> None:
    run = runs["refused"]
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "optimizer.lr: 0.01 -> 0.02" in run.stderr
    assert "checkpoint.allow_changes=[optimizer.lr]" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr and "zerofit plan" not in run.stdout
    cache = config.parent / "cache-refusal"
    assert not cache.exists() or not any(cache.iterdir())  # no tokenizer, no model was loaded
    assert _snapshot(run.run_dir) == BEFORE_REFUSAL  # the run record is untouched


def test_a_resume_trains_with_the_accepted_lr_and_schedule_length(runs: dict[str, RunResult]) -> None:
    """DeepSpeed's loaded optimizer and scheduler state must not put the saved lr and schedule back."""
    from zerofit.strategies.optim import lr_multiplier

    run = runs["retuned"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "changed: optimizer.lr: 0.01 -> 0.005 (accepted by checkpoint.allow_changes)" in run.stdout
    assert f"changed: train.max_steps: {STEPS} -> {RETUNED_STEPS} (accepted" in run.stdout
    rows = run.metrics
    assert [row["step"] for row in rows] == list(range(1, RETUNED_STEPS + 1))
    assert [row["lr"] for row in rows[:STEPS]] == pytest.approx(runs["reference"].series("lr"), rel=1e-12)
    factor = lr_multiplier("cosine", 2, RETUNED_STEPS, 0.0)
    expected = [RETUNED_LR * factor(step) for step in range(STEPS, RETUNED_STEPS)]
    assert [row["lr"] for row in rows[STEPS:]] == pytest.approx(expected, rel=1e-9)


def test_wandb_continues_one_run_and_the_summary_covers_the_whole_run(runs: dict[str, RunResult]) -> None:
    from zerofit.metrics.wandb_reader import read_wandb_run

    final = runs[_key("single", 2)]
    files = sorted((final.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 3  # one offline file per session
    parts = [read_wandb_run(f) for f in files]
    assert len({p.run_id for p in parts}) == 1
    steps = [s for p in parts for s in sorted(p.history)]
    assert sorted(steps) == list(range(1, STEPS + 1))  # every step once, across the sessions
    assert parts[-1].summary["summary/steps"] == STEPS
    summary = json.loads((final.run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["tokens_seen"] == sum(final.series("tokens"))
    assert summary["final_loss"] == final.metrics[-1]["loss"]
    assert f"done: {STEPS} steps" in final.stdout


def test_tensorboard_and_mlflow_keep_one_run_with_every_step_once(runs: dict[str, RunResult]) -> None:
    """Two stops, then a resume from an older checkpoint after step 16 was logged (the fallback): TensorBoard
    shows each step once as trained last (`metrics.jsonl`'s rows), MLflow each step once (the re-trained
    steps with the values first logged, equal within the resume's 1e-5), both in the run they started."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    from zerofit.metrics.mlflow_sink import recorded_run_id

    run = runs["fsdp-fallback"]
    rows, steps = run.metrics, list(range(1, STEPS + 1))
    folder = run.run_dir / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 4  # one per launch, in one directory
    reader = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    reader.Reload()
    for key in ("loss", "lr", "tokens_per_s", "mem/rank0/peak_gib", "mem/rank1/peak_gib"):
        events = reader.Scalars(key)
        logged = [row for row in rows if key in row]
        assert [e.step for e in events] == [row["step"] for row in logged], key
        assert [e.value for e in events] == pytest.approx([row[key] for row in logged], rel=1e-6), key
    client = MlflowClient(f"sqlite:///{run.run_dir.parent}/mlflow.db")
    experiment = client.get_experiment_by_name("job")  # the config file's stem
    run_id = recorded_run_id(run.run_dir / "mlflow_run.json")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert [step for step, _ in history] == steps
    assert max(abs(value - row["loss"]) for (_, value), row in zip(history, rows, strict=True)) < 1e-5
    rank1 = sorted(m.step for m in client.get_metric_history(run_id, "mem/rank1/peak_gib"))
    assert rank1 == steps  # the 2-rank launches' (the fallback's 1 rank resent none of its steps)
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["distributed.strategy"] == "fsdp"
    assert {"config.yaml", "fsdp.json", "run_info.json", "summary.json"} <= {
        a.path for a in client.list_artifacts(run_id)
    }


def test_workers_exit_when_their_launcher_dies(tmp_path: Path, config: Path) -> None:
    """torchrun starts its workers in their own sessions, so killing its process group does not reach them;
    the parent-death signal must end them (instead of training on and racing a resume)."""
    import psutil

    out = tmp_path / "runs"
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--master_port",
        str(free_port()),
        "--nproc_per_node",
        "2",
        str(LAUNCHER),
        "--config",
        str(config),
        f"output_dir={out}",
        "run_name=orphan",
        "distributed.strategy=ddp",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with (tmp_path / "log").open("w") as log:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
    metrics = out / "orphan" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
        time.sleep(0.05)
    workers = psutil.Process(launcher.pid).children()
    assert len(workers) == 2 and all(os.getsid(w.pid) != os.getsid(launcher.pid) for w in workers)
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    _, alive = psutil.wait_procs(workers, timeout=20)
    for worker in alive:
        worker.kill()
    assert not alive, "workers kept running after their launcher was killed"
    assert len(metrics.read_text().splitlines()) < STEPS


def test_one_rank_deepspeed_launches_leave_no_shared_memory_behind(
    runs: dict[str, RunResult], shm_before: set[Path]
) -> None:
    """The zero2 chain's one-rank launch (the `deepspeed` runner, stopped by SIGTERM) creates DeepSpeed's CPU
    allreduce segment (66 MB in /dev/shm) like a 2-rank one; zerofit unlinked it only for 2 ranks or more,
    so every such launch left 66 MB until a reboot."""
    assert CHAINS["zero2"][2][:2] == ("deepspeed", 1) and runs["zero2-3"].returncode != 0
    assert sorted(deepspeed_shm_segments() - shm_before) == []
