"""The launcher's thin front: arguments, launch environment, multi-rank requests, run directories."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerofit.config import load_config
from zerofit.core.errors import LaunchError
from zerofit.recipe.run import parse_args, resolve_for_launch
from zerofit.resolution import resolve
from zerofit.strategies.env import LaunchEnv, launch_env

DATA = str(Path(__file__).resolve().parents[3] / "data" / "demo.jsonl")


def test_local_rank_is_accepted_and_overrides_may_surround_config() -> None:
    args = parse_args(["a.b=1", "--local_rank=1", "--config", "c.yaml", "x.y=2"])
    assert args.config == "c.yaml" and args.overrides == ["a.b=1", "x.y=2"]
    assert parse_args(["--local-rank", "0", "--config", "c.yaml"]).overrides == []


def test_plain_python_gets_one_process_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "x")  # registers the original state, so what launch_env sets is undone
        monkeypatch.delenv(key)
    env = launch_env()
    assert env == LaunchEnv(rank=0, world_size=1, local_rank=0, launched=False)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0


def test_launcher_environment_is_read_not_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch_env() == LaunchEnv(rank=3, world_size=4, local_rank=1, launched=True)


def _config(**batch: int) -> object:
    return load_config(None, [f"data.path={DATA}", *(f"batch.{k}={v}" for k, v in batch.items())])


def test_python_launch_of_a_multi_rank_split_says_how_to_launch() -> None:
    cfg = _config(global_batch_size=16, micro_batch_size=2, grad_accum_steps=2)
    with pytest.raises(LaunchError, match=r"needs 4 data-parallel ranks.*deepspeed --num_gpus 4"):
        resolve_for_launch(cfg, LaunchEnv(0, 1, 0, launched=False))
    # Under a launcher the plain batch error stands (it names every factor).
    with pytest.raises(Exception, match="dp_size=1") as info:
        resolve_for_launch(cfg, LaunchEnv(0, 1, 0, launched=True))
    assert not isinstance(info.value, LaunchError)


def test_deepspeed_precision_the_accelerator_lacks_is_refused() -> None:
    from zerofit.strategies.deepspeed import _check_accelerator_precision

    accelerator = SimpleNamespace(
        is_fp16_supported=lambda: False, is_bf16_supported=lambda: True, device_name=lambda: "cpu"
    )
    with pytest.raises(LaunchError, match=r"train.precision = 'fp16'.*train.precision=bf16"):
        _check_accelerator_precision("fp16", accelerator)
    _check_accelerator_precision("bf16", accelerator)
    _check_accelerator_precision("fp32", accelerator)


_BROKEN = '{"prompt": "a", "response": "b"}\n{"prompt": \n'
# A third of the responses longer than data.max_seq_len=16: refused under data.truncation=error.
_CUT = "".join(f'{{"prompt": "p", "response": "{"r" * (40 if i % 3 == 0 else 5)}"}}\n' for i in range(30))


@pytest.mark.parametrize(
    ("text", "extra", "expected"),
    [
        (_BROKEN, [], r"bad\.jsonl:2"),
        (_CUT, ["data.max_seq_len=16", "data.truncation=error"], r"10 of 30 examples \(33%\) are cut"),
    ],
    ids=["broken-record", "truncation-error"],
)
def test_bad_data_fails_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, extra: list[str], expected: str
) -> None:
    from zerofit.core.errors import DataError
    from zerofit.recipe import assembly

    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(assembly, "build_model", no_model)
    overrides = [
        f"data.path={bad}",
        "batch.global_batch_size=1",
        "batch.micro_batch_size=1",
        "distributed.strategy=single",
        f"output_dir={tmp_path / 'runs'}",
        *extra,
    ]
    with pytest.raises(DataError, match=expected):
        assembly.assemble(resolve(load_config(None, overrides), 1))
    assert not (tmp_path / "runs").exists()  # nothing written for a run that never started


def test_a_launched_process_writes_its_lines_to_a_log_file_as_they_are_printed(tmp_path: Path) -> None:
    """Under nohup, SLURM or `> log` stdout is a file, which Python block-buffers: a line printed without a
    flush (a library's, a rank's) would show only at exit. After `run.main` starts, every line is out at once."""
    import subprocess
    import sys
    import time

    code = (
        "import sys, time; from zerofit.recipe.run import main; main(['--config', 'missing.yaml']); "
        "print('a line printed after the launcher started'); time.sleep(120)"
    )
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell has it
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60  # a bound on the wait (imports), not a speed requirement
        while "a line printed" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "a line printed after the launcher started" in log.read_text()
        assert proc.poll() is None  # still running: the line did not wait for the process to exit
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        (["train.objective=simpo", "preference.beta=2"], "simpo (beta 2, margin gamma 1 (= 0.5 x beta),"),
        (["train.objective=simpo", "preference.beta=2", "preference.simpo_gamma=0.5"], "gamma 0.5 (= 0.25 x"),
        (["train.objective=orpo"], "NLL over the global batch's chosen prompt and response tokens"),
        (
            ["train.objective=orpo", "preference.orpo_prompt_loss=false"],
            "over the global batch's chosen response",
        ),
    ],
)
def test_the_plan_names_simpos_margin_and_what_orpos_nll_is_over(overrides: list[str], shown: str) -> None:
    """The objective line says the margin SimPO trains with (and its ratio to beta, the key's old meaning)
    and ORPO's NLL tokens, so a config written for other meanings shows it."""
    from zerofit.objectives.registry import objective_of

    cfg = load_config(None, overrides)
    cfg.preference.reference = "none"
    assert shown in str(objective_of(cfg).describe(cfg, ""))


def test_a_user_error_is_said_once_per_run_not_once_per_rank() -> None:
    from zerofit.checkpoint.failed_save import error_parts, rebuild_error
    from zerofit.core.errors import ResumeError
    from zerofit.recipe.run import prints_error

    ranks = [LaunchEnv(rank=r, world_size=4, local_rank=r % 2, launched=True) for r in range(4)]
    # A resume refusal: rank 0 decides it and every rank raises the broadcast copy; rank 0 alone says it.
    refusal = rebuild_error(*error_parts(ResumeError("checkpoint.resume: ... saved with a different config")))
    assert isinstance(refusal, ResumeError) and refusal.agreed
    assert [prints_error(refusal, env, from_config=False) for env in ranks] == [True, False, False, False]
    # A config error: every rank reads the same file; once per node (local rank 0), since a node may lack it.
    typo = LaunchError("train.max_stpes: no such key")
    assert [prints_error(typo, env, from_config=True) for env in ranks] == [True, False, True, False]
    # Anything else may be one rank's own: whoever raises it says it.
    assert all(prints_error(typo, env, from_config=False) for env in ranks)


def test_a_silent_rank_leaves_after_the_rank_that_says_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config error under a launcher: local rank 0 says it; rank 1 says nothing and must not exit first
    (DeepSpeed's launch.py ends every rank once one exits non-zero: rank 0 could be ended mid-message)."""
    import zerofit.recipe.run as run

    waits: list[float] = []
    monkeypatch.setattr(run, "leave_after_the_rank_that_says_it", lambda stop: waits.append(1.0))
    monkeypatch.setattr(run, "die_with_parent", lambda: None)
    monkeypatch.setattr(run, "die_with_launcher", lambda stop, rank: None)
    monkeypatch.setattr(run.StopSignal, "install", lambda self: self)
    typo = ["--config", "missing.yaml"]
    for rank, silent in ((1, True), (0, False)):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        for key, value in {**env, "MASTER_PORT": "29500"}.items():
            monkeypatch.setenv(key, value)
        waits.clear()
        assert run.main(typo) == run.EXIT_USER_ERROR
        assert waits == ([1.0] if silent else []), rank
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    waits.clear()
    assert run.main(typo) == run.EXIT_USER_ERROR and waits == []  # a plain `python` start says it itself


def test_a_rank_whose_peer_stopped_says_it_and_exits_75(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank left says the lost peer's paragraph itself (none of them is the one that knows more) and
    exits with EXIT_PEER_LOST, not a user error's 2 (docs/contracts.md, "Entry point")."""
    import zerofit.recipe.run as run
    from zerofit.core.errors import PeerLost

    def lost(*args: object, **kwargs: object) -> None:
        raise PeerLost("rank 0 (pid 4242) stopped (killed, ...), so rank 1 cannot go on (...). No checkpoint")

    monkeypatch.setattr(run, "run_training", lost)
    monkeypatch.setattr(run, "die_with_parent", lambda: None)
    monkeypatch.setattr(run, "die_with_launcher", lambda stop, rank: None)
    monkeypatch.setattr(run.StopSignal, "install", lambda self: self)
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert (
        run.main(["--config", str(Path(DATA).parents[1] / "configs" / "demo.yaml")])
        == run.EXIT_PEER_LOST
        == 75
    )
    assert capsys.readouterr().err.startswith("zerofit (rank 1): error: rank 0 (pid 4242) stopped")


def test_the_silent_rank_waits_until_a_signal_or_a_bound() -> None:
    """The launcher's signal ends the wait (a stop request during training: no exit at once), and without
    one the wait is bounded."""
    import signal
    import time

    from zerofit.loop.signals import StopSignal
    from zerofit.recipe import run

    stop = StopSignal(rank=1)
    started = time.monotonic()
    run.leave_after_the_rank_that_says_it(stop, wait_s=0.3)
    assert 0.3 <= time.monotonic() - started < 5
    stop.signum = signal.SIGTERM  # what the handler records for a request during training
    started = time.monotonic()
    run.leave_after_the_rank_that_says_it(stop, wait_s=30)
    assert time.monotonic() - started < 1
    assert 0 < run.SILENT_RANK_WAIT_S <= 60
