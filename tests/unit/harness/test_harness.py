"""`zerofit eval` and the lm-eval tasks zerofit ships: the tasks over local files (their verdicts, their data
where this install keeps it, the YAMLs as lm-eval itself reads them), the flags' and the tasks' refusals as
one paragraph (a hub task whose data cannot be fetched offline included), and a real run scored end to end
on the built-in tiny-llama: the results file, the post-hoc metrics row laid over the step's training row
(compare and a resume's rewind keep both), the W&B run's summary read back offline, and compare's table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zerofit.cli import main
from zerofit.core.run_layout import RunLayout, harness_file_name
from zerofit.harness.checks import capitals_result, format_result, sums_result
from zerofit.harness.shipped import TASKS_DIR, data_dir, shipped_names, task_config
from zerofit.metrics.history import rewind_metrics
from zerofit.metrics.keys import POSTHOC, harness_field, harness_task_metric
from zerofit.metrics.rows import one_row_per_step

REPO = Path(__file__).resolve().parents[3]
SHIPPED = ["zerofit_demo_capitals", "zerofit_demo_format", "zerofit_demo_sums"]


def test_the_shipped_tasks_read_the_demos_held_out_files() -> None:
    assert shipped_names() == SHIPPED
    files = {name: Path(task_config(name)["dataset_kwargs"]["data_files"]["test"]) for name in SHIPPED}
    assert files == {
        "zerofit_demo_capitals": data_dir() / "demo_smollm2_facts.jsonl",
        "zerofit_demo_format": data_dir() / "demo_smollm2_heldout.jsonl",
        "zerofit_demo_sums": data_dir() / "demo_grpo_heldout.jsonl",
    }
    assert all(path.is_file() for path in files.values())
    assert [len(p.read_text().splitlines()) for p in files.values()] == [16, 20, 10]


def test_lm_evals_own_loader_reads_the_shipped_yamls() -> None:
    """`lm_eval --include_path src/zerofit/harness/tasks` runs them as they are: its loader resolves the
    `!function` verdicts to the same functions zerofit's loader does."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for name in SHIPPED:
        theirs = load_yaml(TASKS_DIR / f"{name}.yaml")
        assert theirs["task"] == name and theirs["process_results"] is task_config(name)["process_results"]


def test_the_verdicts_of_the_shipped_tasks() -> None:
    assert format_result({}, ['{"answer": "blue"}']) == {"acc": 1.0}
    assert format_result({}, ["The sky is blue."]) == {"acc": 0.0}
    assert capitals_result({"answer": "Vienna"}, ["It is vienna."]) == {"acc": 1.0}
    assert capitals_result({"answer": "Vienna"}, ["Berlin"]) == {"acc": 0.0}
    assert sums_result({"answer": "5"}, [" 5"]) == {"acc": 1.0}
    assert sums_result({"answer": "5"}, ["6"]) == {"acc": 0.0}


def test_a_shipped_yaml_may_name_only_zerofits_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "zerofit_demo_bad.yaml"
    bad.write_text((TASKS_DIR / "zerofit_demo_sums.yaml").read_text().replace("zerofit.harness.checks", "os"))
    monkeypatch.setattr("zerofit.harness.shipped.TASKS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"may name only zerofit\.harness\.checks"):
        task_config("zerofit_demo_bad")


def test_the_results_file_name() -> None:
    assert harness_file_name(24) == "harness-step-24.json"
    assert RunLayout(Path("r")).harness(3) == Path("r/eval/harness-step-3.json")
    assert harness_task_metric(harness_field("zerofit_demo_format", "acc")) == ("zerofit_demo_format", "acc")
    assert harness_task_metric("eval/loss") is None


def test_a_posthoc_row_joins_its_steps_training_row() -> None:
    rows = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.5},
        {"step": 2, POSTHOC: True, "harness/t/acc": 0.5},
        {"step": 2, POSTHOC: True, "harness/t/acc": 0.75},
    ]
    assert one_row_per_step(rows) == [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.5, "harness/t/acc": 0.75},
    ]
    # a training row logged again (a resume) still replaces the earlier one
    assert one_row_per_step([{"step": 1, "loss": 3.0}, {"step": 1, "loss": 2.0}]) == [
        {"step": 1, "loss": 2.0}
    ]


def test_a_resumes_rewind_keeps_the_training_row_and_the_scores(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.5},
        {"step": 2, POSTHOC: True, "harness/t/acc": 0.5},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    assert rewind_metrics(path, 2)[-1] == {"step": 2, "loss": 2.5, "harness/t/acc": 0.5}
    assert [json.loads(line) for line in path.read_text().splitlines()][-1]["loss"] == 2.5


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tasks", "zerofit_demo_sums", "--limit", "0"], "--limit 0: must be > 0"),
        (["--tasks", "zerofit_demo_sums", "--batch-size", "x"], "--batch-size 'x': must be a whole number"),
        (["--tasks", ","], "name at least one task"),
        (
            ["--tasks", "zerofit_demo_formatt"],
            "--tasks zerofit_demo_formatt: no such lm-eval task; zerofit ships",
        ),
    ],
)
def test_bad_flags_and_unknown_tasks_are_one_paragraph(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "tiny-llama", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_a_hub_task_offline_without_its_data_is_refused_in_one_paragraph(tmp_path: Path) -> None:
    """gsm8k with the Hub unreachable (HF_HUB_OFFLINE, an empty cache): one paragraph naming the task, the
    reason and the offline tasks zerofit ships, exit 2, before any model loads."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "-m", "zerofit.cli", "eval", "tiny-llama", "--tasks", "gsm8k"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "lm-eval task 'gsm8k': its data cannot be fetched" in proc.stderr
    assert "zerofit_demo_format" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo config on one process for 2 steps, W&B offline (its summary is read back), TensorBoard and
    MLflow on (the default store: sqlite under output_dir), with `eval.harness` scoring the sums task after
    each step and judging the best checkpoint."""
    from zerofit.api import train

    result = train(
        str(REPO / "configs" / "demo.yaml"),
        **{
            "distributed.strategy": "single",
            "distributed.preset": None,
            "train.max_steps": 2,
            "train.precision": "fp32",
            "output_dir": str(tmp_path_factory.mktemp("eval")),
            "run_name": "tiny",
            "logging.console": False,
            "data.path": str(REPO / "data" / "demo.jsonl"),
            "eval.harness.tasks": ["zerofit_demo_sums"],
            "eval.harness.every_steps": 1,
            "eval.harness.limit": 2,
            "eval.harness.best_metric": "zerofit_demo_sums/acc",
            "logging.tensorboard": True,
            "logging.mlflow.enabled": True,
        },
    )
    return result.run_dir


@pytest.mark.slow
def test_eval_harness_scores_every_step_and_judges_the_best_checkpoint(tiny_run: Path) -> None:
    """`eval.harness` during training: each step's row has its score, its results file its replies, and
    `checkpoints/best.json` names the harness metric (the first evaluation is the best until one beats it)."""
    from zerofit.checkpoint.policy import read_best
    from zerofit.metrics.rows import read_rows

    key = harness_field("zerofit_demo_sums", "acc")
    training = [row for row in read_rows(RunLayout(tiny_run).metrics).rows if not row.get(POSTHOC)]
    assert [row["step"] for row in training] == [1, 2] and all(key in row for row in training)
    report = json.loads(RunLayout(tiny_run).harness(1).read_text())
    assert len(report["replies"]["trained"]["zerofit_demo_sums"]) == 2
    best = read_best(RunLayout(tiny_run).checkpoints)
    assert best is not None and best["metric"] == key and best["step"] in (1, 2)


@pytest.mark.slow
def test_the_harness_scores_of_a_run_reach_every_sink(tiny_run: Path) -> None:
    """One run's `eval.harness` scores, each step's, in metrics.jsonl, W&B's history, TensorBoard's event
    files (read by TensorBoard's own reader) and its MLflow run (MLflow's client on the default store)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    from zerofit.metrics.rows import read_rows
    from zerofit.metrics.wandb_reader import read_wandb_run

    layout = RunLayout(tiny_run)
    key = harness_field("zerofit_demo_sums", "acc")
    rows = {r["step"]: r[key] for r in read_rows(layout.metrics).rows if not r.get(POSTHOC) and key in r}
    assert sorted(rows) == [1, 2]
    history = read_wandb_run(layout.wandb).history
    assert {step: history[step][key] for step in rows} == rows
    reader = EventAccumulator(str(layout.tensorboard), size_guidance={SCALARS: 0})
    reader.Reload()
    assert {e.step: e.value for e in reader.Scalars(key)} == pytest.approx(rows)
    run_id = json.loads(layout.mlflow_run.read_text())["run_id"]
    client = MlflowClient(f"sqlite:///{tiny_run.parent}/mlflow.db")
    assert {m.step: m.value for m in client.get_metric_history(run_id, key)} == pytest.approx(rows)


@pytest.fixture(scope="module")
def evaluated(tiny_run: Path) -> str:
    """`zerofit eval` of the tiny run on the sums task (3 documents), its stdout."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerofit.cli",
            "eval",
            str(tiny_run),
            "--tasks",
            "zerofit_demo_sums",
            "--limit",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_eval_of_a_run_prints_base_and_trained_and_writes_the_results(tiny_run: Path, evaluated: str) -> None:
    header, line = evaluated.splitlines()[:2]
    assert header.split() == ["task", "metric", "base", "trained"]
    assert line.split()[:2] == ["zerofit_demo_sums", "acc"] and len(line.split()) == 4
    report = json.loads(RunLayout(tiny_run).harness(2).read_text())
    assert (
        report["step"] == 2
        and report["settings"]["limit"] == 3
        and not report["settings"]["apply_chat_template"]
    )
    assert set(report["scores"]) == {"base", "trained"}
    assert report["lm_eval"]["trained"]["n-samples"]["zerofit_demo_sums"]["effective"] == 3
    assert f"results: {RunLayout(tiny_run).harness(2)}" in evaluated


@pytest.mark.slow
def test_the_scores_reach_metrics_jsonl_wandb_and_compare(
    tiny_run: Path, evaluated: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerofit.metrics.runs import load_run
    from zerofit.metrics.wandb_reader import find_run_file, read_wandb_run

    key = harness_field("zerofit_demo_sums", "acc")
    trained = json.loads(RunLayout(tiny_run).harness(2).read_text())["scores"]["trained"][
        "zerofit_demo_sums"
    ]["acc"]
    last = json.loads(RunLayout(tiny_run).metrics.read_text().splitlines()[-1])
    assert last == {"step": 2, POSTHOC: True, key: trained}
    row = load_run(tiny_run).rows[-1]
    assert row["step"] == 2 and row[key] == trained and "loss" in row  # laid over the training row
    summary: dict[str, Any] = read_wandb_run(find_run_file(RunLayout(tiny_run).wandb)).summary
    assert summary[key] == trained and summary["harness/step"] == 2
    assert main(["compare", str(tiny_run), "--no-plots"]) == 0
    table = capsys.readouterr().out
    assert key in table and f"{trained:.4f} (step 2)" in table


def test_the_watch_of_a_harness_score_keeps_the_highest() -> None:
    """`eval.harness.best_metric`: higher is better, by more than min_delta; the patience counts the rest."""
    from zerofit.checkpoint.policy import EvalWatch

    watch = EvalWatch(patience=2, min_delta=0.05, metric=harness_field("t", "acc"), higher=True)
    for step, score in ((1, 0.2), (2, 0.5), (3, 0.52), (4, 0.4)):
        verdict = watch.judge(score)
        watch.record(step, score, verdict)
    assert (watch.best_step, watch.best_value, watch.stopped_at) == (2, 0.5, 4)
    assert "harness/t/acc has not improved by more than 0.05 for 2" in watch.stop_line()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["eval.harness.tasks=[zerofit_demo_sums]", "eval.harness.best_metric=zerofit_demo_format/acc"],
            "eval.harness.best_metric = 'zerofit_demo_format/acc': must be <task>/<metric> of a task in "
            "eval.harness.tasks (zerofit_demo_sums)",
        ),
        (
            [
                "eval.harness.tasks=[zerofit_demo_sums]",
                "eval.harness.best_metric=zerofit_demo_sums/acc",
                "train.early_stopping.patience=2",
            ],
            "train.early_stopping.patience = 2 counts harness evaluations of zerofit_demo_sums/acc, but "
            "eval.harness.every_steps = 0",
        ),
    ],
)
def test_the_harness_keys_are_checked_before_a_launch(
    overrides: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--config", str(REPO / "configs" / "demo.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
