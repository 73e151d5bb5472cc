"""TensorBoard and MLflow sinks: the rows of metrics.jsonl, read back with each tool's own reader.

TensorBoard's event files are read with TensorBoard's `EventAccumulator`; MLflow runs through a real
`mlflow server` this module starts on localhost (sqlite backend in a temporary folder, stopped after), through
the default store (sqlite under output_dir) and through MLflow's file store. A resume (a launch killed after
its checkpoint at step 4 had logged steps 5-6, resumed from step 4) leaves one TensorBoard run and one MLflow run
with every step once. The sinks are opened as a run opens them (`open_sinks`), on the run's real files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from config_helpers import DEMO_DATA, REPO, new_run_plan
from launch_helpers import free_port
from zerofit.cli import main
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import RunLayout
from zerofit.engine_spec.run_plan import RunPlan
from zerofit.metrics.base import NullSink
from zerofit.metrics.history import rewind_metrics
from zerofit.metrics.mlflow_sink import metric_name, recorded_run_id
from zerofit.metrics.runs import load_run
from zerofit.metrics.setup import open_sinks
from zerofit.resolution import resolve

CHECKPOINT, KILLED_AT, END = 4, 6, 8
# A key lm-eval's scores take (a comma: MLflow refuses it in a name), logged like any other row key.
HARNESS = "harness/demo_format/exact_match,strict-match"


def _row(step: int, launch: int) -> dict[str, Any]:
    """A row as the loop logs it (rank 0 carries every rank's memory), its values told apart by `launch`."""
    row: dict[str, Any] = {
        "loss": 2.0 / step + 0.01 * launch,
        "lr": 1e-3 * step,
        "tokens": 40 + step,
        "tokens_per_s": 100.0 * launch + step,
        "mem/rank0/peak_gib": 0.25 + 0.001 * step,
        "mem/rank1/peak_gib": 0.30 + 0.001 * step,
        "mem/source": "cpu",
        "rewards/accuracies": 0.5,
    }
    if step % 2 == 0:
        row["eval/loss"] = 1.5 / step + 0.01 * launch
    if step == KILLED_AT:
        row[HARNESS] = 0.25 * launch
    return row


def _plan(root: Path, name: str, *, mlflow_uri: str | None = None, experiment: str = "trackers") -> RunPlan:
    cfg = ZerofitConfig(output_dir=str(root / "runs"), run_name=name)
    cfg.data.path = DEMO_DATA
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 2, 1
    cfg.logging.wandb.mode, cfg.logging.console = "disabled", False
    cfg.logging.tensorboard = True
    cfg.logging.mlflow.enabled = True
    cfg.logging.mlflow.tracking_uri = mlflow_uri
    cfg.logging.mlflow.experiment = experiment
    plan = new_run_plan(resolve(cfg, 1))
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    (plan.run_dir / "config.yaml").write_text("seed: 1\n")  # what the run writes before its sinks open
    return plan


def _killed_and_resumed(plan: RunPlan) -> list[dict[str, Any]]:
    """Launch 1 logs steps 1-6 (its checkpoint: step 4) and is killed; launch 2 resumes from step 4 (metrics.jsonl
    rewound, as a resume does) and logs steps 5-8. Returns metrics.jsonl's rows at the end."""
    sink = open_sinks(plan, 0, {"parameters": 1234})
    for step in range(1, KILLED_AT + 1):
        sink.log(step, _row(step, 1))
    sink.close()
    layout = RunLayout(plan.run_dir)
    history = rewind_metrics(layout.metrics, CHECKPOINT)
    sink = open_sinks(plan, 0, {"parameters": 1234}, history=history)
    for step in range(CHECKPOINT + 1, END + 1):
        sink.log(step, _row(step, 2))
    sink.close()
    return [json.loads(line) for line in layout.metrics.read_text().splitlines()]


def _numeric_series(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                series.setdefault(key, {})[row["step"]] = float(value)
    return series


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1 (sqlite backend, artifacts in a temporary folder), stopped after."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/server.db",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = (root / "server.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert server.poll() is None, (root / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, (root / "server.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    yield uri
    os.killpg(server.pid, signal.SIGTERM)  # the server's own process group: its workers too
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    log.close()


@pytest.fixture(scope="module")
def served(
    mlflow_server: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunPlan, list[dict[str, Any]]]:
    """A run killed and resumed, logging to the server (named by MLFLOW_TRACKING_URI) and to TensorBoard."""
    root = tmp_path_factory.mktemp("served")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server
    try:
        plan = _plan(root, "served")
        return plan, _killed_and_resumed(plan)
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


def _mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def _assert_one_mlflow_run(uri: str, plan: RunPlan, rows: list[dict[str, Any]]) -> None:
    """One MLflow run for the run folder, each metric's steps once: metrics.jsonl's rows (the resumed steps
    5-6 with the values first logged), its config as parameters, its files as artifacts."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = recorded_run_id(RunLayout(plan.run_dir).mlflow_run)
    experiment = client.get_experiment_by_name("trackers")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == plan.run_name
    for key, by_step in _numeric_series(rows).items():
        history = _mlflow_history(uri, run_id, metric_name(key))
        assert [step for step, _ in history] == sorted(by_step), key  # every step once
        first = {s: v for s, v in history if CHECKPOINT < s <= KILLED_AT}
        expected = {s: _numeric_series([{"step": s, **_row(s, 1)}]).get(key, {}).get(s) for s in first}
        assert first == expected, key  # re-logged steps: MLflow keeps the values first logged
        later = {s: v for s, v in history if s > KILLED_AT}
        assert later == pytest.approx({s: by_step[s] for s in later}), key
    assert metric_name(HARNESS) == "harness/demo_format/exact_match_strict-match"
    assert run.data.tags["mem/source"] == "cpu"
    assert run.data.params["parameters"] == "1234" and run.data.params["optimizer.lr"] == "0.0002"
    assert run.data.params["batch_plan.micro_batch_size"] == "1"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "run_info.json", "summary.json"} <= artifacts


@pytest.mark.slow
def test_an_mlflow_server_holds_one_run_with_every_row_once(
    served: tuple[RunPlan, list[dict[str, Any]]], mlflow_server: str
) -> None:
    plan, rows = served
    assert [row["step"] for row in rows] == list(range(1, END + 1))
    _assert_one_mlflow_run(mlflow_server, plan, rows)


@pytest.mark.slow
def test_tensorboard_holds_one_run_with_metrics_jsonl_rows(
    served: tuple[RunPlan, list[dict[str, Any]]],
) -> None:
    """TensorBoard's own reader: each step once, as trained last (the resume purged steps 5-6 of launch 1)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    plan, rows = served
    folder = RunLayout(plan.run_dir).tensorboard
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # one file per launch, one directory
    reader = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    reader.Reload()
    expected = _numeric_series(rows)
    assert set(reader.Tags()["scalars"]) == set(expected)  # every key, whatever it is: no fixed list
    for key, by_step in expected.items():
        events = reader.Scalars(key)
        assert [e.step for e in events] == sorted(by_step), key
        assert [e.value for e in events] == pytest.approx([by_step[s] for s in sorted(by_step)], rel=1e-6)
    assert HARNESS in expected and "mem/rank1/peak_gib" in expected
    hparams = reader.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams


@pytest.mark.slow
def test_compare_reads_a_tensorboard_directory(
    served: tuple[RunPlan, list[dict[str, Any]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan, rows = served
    copy = tmp_path / "only-tensorboard"
    shutil.copytree(RunLayout(plan.run_dir).tensorboard, copy)
    run = load_run(copy)
    assert run.source == "tensorboard" and run.label == "served"
    assert [r["step"] for r in run.rows] == list(range(1, END + 1))
    assert [r["loss"] for r in run.rows] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert run.rows[0]["mem/source"] == "cpu" and run.ranks() == [0, 1]
    assert run.config["optimizer"]["lr"] == pytest.approx(2e-4)
    assert main(["compare", str(copy), str(plan.run_dir), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "tensorboard" in out and "metrics.jsonl" in out


@pytest.mark.slow
def test_the_default_store_is_sqlite_under_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    plan = _plan(tmp_path, "local")
    rows = _killed_and_resumed(plan)
    store = tmp_path / "runs" / "mlflow.db"
    assert store.is_file() and (tmp_path / "runs" / "mlartifacts").is_dir()
    assert (
        "sqlite" not in (plan.run_dir / "mlflow_run.json").read_text()
    )  # the URI stays out of the run folder
    _assert_one_mlflow_run(f"sqlite:///{store}", plan, rows)


@pytest.mark.slow
def test_mlflows_file_store_and_the_config_key_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the config's key wins over it
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store without it
    store = tmp_path / "mlruns"
    plan = _plan(tmp_path, "files", mlflow_uri=store.as_uri())
    rows = _killed_and_resumed(plan)
    assert any(store.glob("*/meta.yaml"))
    _assert_one_mlflow_run(store.as_uri(), plan, rows)


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "rank1")
    assert isinstance(open_sinks(plan, 1, {}), NullSink)
    assert not RunLayout(plan.run_dir).tensorboard.exists()
    assert not RunLayout(plan.run_dir).mlflow_run.exists()


@pytest.mark.parametrize(("extra", "override"), [("tensorboard", "logging.tensorboard=true"),
                                                  ("mlflow", "logging.mlflow.enabled=true")])  # fmt: skip
def test_a_tracker_that_is_not_installed_is_one_paragraph_with_its_install_command(
    extra: str, override: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from zerofit.config.rules import training

    real = importlib.util.find_spec
    monkeypatch.setattr(
        training.importlib.util, "find_spec", lambda name: None if name == extra else real(name)
    )
    args = ["plan", "--config", str(REPO / "configs" / "demo.yaml"), override]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"pip install 'zerofit[{extra}]'" in err and "not installed" in err
    assert "Traceback" not in err
    cfg = ZerofitConfig()
    cfg.data.path = DEMO_DATA
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 2, 1
    cfg.logging.tensorboard = True
    cfg.logging.mlflow.enabled = True
    with pytest.raises(ConfigError) as raised:
        resolve(cfg, 1)
    assert len([p for p in raised.value.problems if "not installed" in p]) == 1


def test_a_store_that_cannot_be_reached_is_a_notice_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zerofit.metrics.mlflow_sink import MlflowSink

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    plan = _plan(tmp_path, "unreachable", mlflow_uri=f"http://127.0.0.1:{free_port()}")
    notices: list[str] = []
    sink = MlflowSink(plan, notice=notices.append)
    sink.log(1, _row(1, 1))
    sink.close()
    assert len(notices) == 1 and "MLflow could not start" in notices[0] and "metrics.jsonl" in notices[0]
