"""open_sinks, the console sink, the W&B sink's fallbacks, and the run summary."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from config_helpers import new_run_plan
from zerofit.config.schema import ZerofitConfig
from zerofit.engine_spec.run_plan import RunPlan
from zerofit.metrics.base import MultiSink, NullSink
from zerofit.metrics.console import ConsoleSink
from zerofit.metrics.setup import open_sinks, run_config
from zerofit.metrics.summary import RunSummary, describe_trends, judged_series, judged_trends
from zerofit.metrics.wandb_sink import WandbSink, default_group, default_name
from zerofit.resolution import resolve


def _resolved(tmp_path: Path, world_size: int = 2, console: bool = True, **wandb: object) -> RunPlan:
    """The run plan of a new run (W&B keys from `wandb`), as a launch hands it to the sinks."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    cfg = ZerofitConfig()
    cfg.output_dir = str(tmp_path / "runs")
    cfg.data.path = str(data)
    cfg.batch.global_batch_size = 8
    cfg.batch.micro_batch_size = 2
    cfg.train.max_steps = 4
    for key, value in wandb.items():
        setattr(cfg.logging.wandb, key, value)
    cfg.logging.console = console
    return new_run_plan(resolve(cfg, world_size))


def _step_metrics(step: int) -> dict[str, object]:
    return {
        "loss": 2.0 / step,
        "lr": 1e-3,
        "tokens": 50,
        "tokens_per_s": 100.0 * step,
        "mem/source": "cpu_rss",
        "mem/max_peak_gib": 1.0 + step,
        "mem/rank0/peak_gib": 0.5 + step,
        "mem/rank1/peak_gib": 1.0 + step,
    }


@pytest.fixture
def no_wandb_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_non_zero_ranks_get_a_null_sink(tmp_path: Path) -> None:
    resolved = _resolved(tmp_path, mode="disabled")
    assert isinstance(open_sinks(resolved, 1, {}), NullSink)
    assert not resolved.run_dir.exists()  # rank 1 writes nothing


def test_rank0_writes_jsonl_run_info_and_summary(tmp_path: Path) -> None:
    resolved = _resolved(tmp_path, console=False, mode="disabled")
    sink = open_sinks(resolved, 0, {"params": {"trainable": 10, "total": 100}})
    assert isinstance(sink, MultiSink)
    for step in range(1, 5):
        sink.log(step, _step_metrics(step))
    sink.close()
    sink.close()  # safe twice
    rows = [json.loads(line) for line in (resolved.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["mem/rank1/peak_gib"] == 5.0
    info = json.loads((resolved.run_dir / "run_info.json").read_text())
    assert info["batch_plan"] == {
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "grad_accum_steps": 2,
        "dp_size": 2,
    }
    assert info["params"] == {"trainable": 10, "total": 100}
    assert info["versions"]["torch"]
    summary = json.loads((resolved.run_dir / "summary.json").read_text())
    assert summary["final_loss"] == 0.5
    assert summary["peak_gib"] == 5.0
    assert summary["peak_gib_rank0"] == 4.5
    assert not (resolved.run_dir / "wandb").exists()  # disabled means no W&B files


def test_run_config_holds_plan_versions_commit(tmp_path: Path) -> None:
    resolved = _resolved(tmp_path)
    config = run_config(resolved, {"params_trainable": 10})
    assert config["batch_plan"]["dp_size"] == 2
    assert config["distributed"]["preset"] == "zero2"
    assert config["engine_config"] == resolved.spec.to_json()  # what the engine received
    assert config["engine_config"]["zero_optimization"]["stage"] == 2
    assert config["params_trainable"] == 10
    assert set(config["versions"]) >= {"python", "torch", "wandb"}
    assert "commit" in config["git"] or config["git"] == {}
    json.dumps(config)  # JSON-able as a whole


def test_summary_mean_throughput_skips_warmup_step() -> None:
    summary = RunSummary(predicted_peak=4.0)
    for step in range(1, 5):
        summary.update(step, _step_metrics(step), now=float(step))
    result = summary.result()
    assert result["mean_tokens_per_s"] == pytest.approx(300.0)  # steps 2..4
    assert result["min_loss"] == 0.5
    assert result["tokens_seen"] == 200
    assert result["wall_s"] == 3.0
    assert "predicted_over_measured" not in result  # RSS is not comparable with a tensor prediction
    summary.update(5, {**_step_metrics(5), "mem/source": "cuda"}, now=5.0)
    assert summary.result()["predicted_over_measured"] == pytest.approx(4.0 / 6.0)


def test_the_end_of_run_table_counts_optimizer_steps_not_logged_rows() -> None:
    """logging.log_every=3 over 8 steps logs steps 3, 6 and 8 (the last is always logged); a resumed run
    replays the kept rows before its own: both say 8 optimizer steps, as the run did."""
    buffer = io.StringIO()
    sink = ConsoleSink(8, console=Console(file=buffer, force_terminal=False, width=120))
    for step in (3, 6, 8):
        sink.log(step, _step_metrics(step))
    sink.close()
    assert re.search(r"optimizer steps\s+│\s+8 ", buffer.getvalue()), buffer.getvalue()
    resumed = RunSummary()
    resumed.replay([{"step": s, **_step_metrics(s)} for s in (3, 6)])  # the rows up to the checkpoint
    resumed.update(8, _step_metrics(8))
    assert resumed.result()["steps"] == 8 and resumed.logged_rows == 3


def test_tokens_seen_is_the_rows_running_count_not_a_sum_over_logged_rows(tmp_path: Path) -> None:
    """logging.log_every=3 over 8 steps of 50 label tokens logs steps 3, 6 and 8, each with the loop's
    `tokens_seen`: the summary (console table, summary.json, compare) and the tokens x-axis say 400, not the
    150 of the three logged rows. Rows from before the field (no `tokens_seen`) still add up `tokens`."""
    from metrics_fixtures import make_run

    from zerofit.metrics.runs import load_run
    from zerofit.metrics.summary import tokens_seen_through

    rows = [{"step": s, **_step_metrics(s), "tokens_seen": 50 * s} for s in (3, 6, 8)]
    summary = RunSummary()
    for row in rows:
        summary.update(row["step"], row)
    assert summary.result()["tokens_seen"] == 400
    resumed = RunSummary()  # an old run's rows up to its checkpoint, then rows that count
    resumed.replay([{"step": s, **_step_metrics(s)} for s in (3, 6)])
    assert resumed.result()["tokens_seen"] == 100
    resumed.update(8, rows[-1])
    assert resumed.result()["tokens_seen"] == 400
    assert tokens_seen_through(rows[:2]) == 300 and tokens_seen_through([_step_metrics(1)] * 2) == 100
    run = load_run(make_run(tmp_path, "every-3"))
    run.rows = rows
    assert run.series("loss", x="tokens_seen")[0] == [150.0, 300.0, 400.0]
    assert run.summary()["tokens_seen"] == 400


def test_console_off_terminal_prints_compact_lines_and_a_table() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False, width=120)
    sink = ConsoleSink(10, every=5, console=console)
    for step in range(1, 11):
        sink.log(step, _step_metrics(step))
    sink.close()
    text = buffer.getvalue()
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/10", "5/10", "10/10"]
    assert "loss 0.2000" in lines[-1] and "tok/s" in lines[-1] and "peak 11.00 GiB" in lines[-1]
    assert "\x1b[" not in text  # no control codes off-terminal
    assert "last step's loss (one batch)" in text and "rank 1 peak" in text


def test_the_summary_leads_with_a_smoothed_loss_and_the_held_out_loss() -> None:
    # A noisy last batch beside the run's lowest one reads as a regression: the summary leads with the mean
    # of the last steps (which it names) and the held-out loss, the raw values after them, labelled as such.
    buffer = io.StringIO()
    sink = ConsoleSink(10, console=Console(file=buffer, force_terminal=False, width=120))
    for step in range(1, 11):  # 2.0/step: the last 5 steps average (2/6 + ... + 2/10) / 5
        sink.log(step, {**_step_metrics(step), **({"eval/loss": 0.25} if step == 10 else {})})
    sink.close()
    rows = [
        " ".join(line.strip("│ ").split())
        for line in buffer.getvalue().splitlines()
        if "loss" in line and "│" in line
    ]
    smoothed = sum(2.0 / s for s in range(6, 11)) / 5
    assert rows == [
        f"loss, mean of the last 5 step(s) │ {smoothed:.4f}",
        "held-out loss (eval/loss, last evaluation) │ 0.2500",
        "last step's loss (one batch) │ 0.2000",
        "lowest step's loss (one batch) │ 0.2000",
    ]
    assert sink.summary.result()["smoothed_loss_steps"] == 5


def test_console_on_terminal_shows_a_progress_bar() -> None:
    buffer = io.StringIO()
    sink = ConsoleSink(4, console=Console(file=buffer, force_terminal=True, width=160))
    for step in range(1, 5):
        sink.log(step, _step_metrics(step))
    sink.close()
    text = buffer.getvalue()
    assert "4/4" in text and "loss 0.5000" in text and "mean of the last 2 step(s)" in text


@pytest.mark.parametrize("terminal", [False, True])
def test_a_run_that_logged_no_step_prints_no_summary_table(terminal: bool) -> None:
    """An error before the first step (a failed import, a reward failing at step 1) closes the sinks of a run
    that never trained: no table of zeros ("wall time 0.0 s") above the error, a resume's replayed rows
    included; one logged step brings the table back."""
    for replayed in ([], [{"step": s, **_step_metrics(s)} for s in (1, 2)]):
        buffer = io.StringIO()
        sink = ConsoleSink(4, console=Console(file=buffer, force_terminal=terminal, width=160))
        sink.resume_from(replayed, 12.0)
        sink.close()
        assert "summary" not in buffer.getvalue() and "wall time" not in buffer.getvalue()
    sink = ConsoleSink(4, console=Console(file=buffer, force_terminal=terminal, width=160))
    sink.log(1, _step_metrics(1))
    sink.close()
    assert "zerofit: train summary" in buffer.getvalue()


def test_default_group_and_name_make_sweeps_comparable(tmp_path: Path) -> None:
    resolved = _resolved(tmp_path)
    assert default_name(resolved) == "zero2-g8-m2x2x2"
    assert default_group(resolved) == "tiny-llama-lora-zero2-bf16"  # run name minus the split
    assert default_group(resolved, "configs/demo.yaml") == "demo"


@pytest.mark.slow
@pytest.mark.serial  # it terminates every child of the test process: alone, beside nothing else's
def test_wandb_outlives_a_launcher_that_terminates_the_ranks_process_tree(
    tmp_path: Path, no_wandb_key: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On Ctrl-C, DeepSpeed's launch.py terminates every descendant of each rank (terminate_process_tree),
    # W&B's service included, while the rank finishes its step and saves: the W&B run must still end whole.
    import psutil

    from zerofit.metrics.runs import load_run

    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    resolved = _resolved(tmp_path, mode="offline")
    notices: list[str] = []
    sink = WandbSink(resolved, notice=notices.append, outlive_launcher=True)
    sink.log(1, _step_metrics(1))
    tree = psutil.Process().children(recursive=True)
    for process in tree:
        process.terminate()
    psutil.wait_procs(tree, timeout=10)
    sink.log(2, _step_metrics(2))
    sink.close()
    assert not [n for n in notices if "W&B" in n and "offline (no API key" not in n], notices
    assert [row["step"] for row in load_run(resolved.run_dir).rows] == [1, 2]  # read from the W&B file
    assert "WANDB_SERVICE" not in os.environ


def test_mode_unset_without_key_falls_back_to_offline_with_notice(tmp_path: Path, no_wandb_key: None) -> None:
    resolved = _resolved(tmp_path)  # logging.wandb.mode left unset
    assert resolved.config.logging.wandb.mode == "offline"
    notices: list[str] = []
    sink = WandbSink(resolved, notice=notices.append)
    sink.log(1, _step_metrics(1))
    sink.close()
    assert len(notices) == 1 and "offline" in notices[0] and "no API key" in notices[0]
    assert list((resolved.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_online_init_failure_falls_back_to_offline(
    tmp_path: Path, no_wandb_key: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    real_init = wandb.init
    modes: list[str] = []

    def flaky_init(*args: object, mode: str, **kwargs: object) -> object:
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.CommError("network unreachable")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", flaky_init)
    resolved = _resolved(tmp_path, mode="online")
    notices: list[str] = []
    sink = WandbSink(resolved, notice=notices.append)
    assert sink.mode == "offline" and modes == ["online", "offline"]
    sink.close()
    assert any("falling back to offline" in n for n in notices)
    assert list((resolved.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_that_cannot_start_never_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    def broken_init(*args: object, **kwargs: object) -> object:
        raise RuntimeError("broken install")

    monkeypatch.setattr(wandb, "init", broken_init)
    notices: list[str] = []
    sink = WandbSink(_resolved(tmp_path, mode="offline"), notice=notices.append, key_configured=True)
    sink.log(1, _step_metrics(1))  # a no-op, not an error
    sink.close()
    assert sink.run is None and any("metrics.jsonl only" in n for n in notices)


def test_planner_failure_never_blocks_logging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerofit.planner import scenario

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("planner bug")

    monkeypatch.setattr(scenario, "scenario_for", broken)
    resolved = _resolved(tmp_path)
    config = run_config(resolved)
    assert "planner_prediction" not in config and config["batch_plan"]["dp_size"] == 2


def test_planner_prediction_is_recorded_beside_the_planner_section(tmp_path: Path) -> None:
    resolved = _resolved(tmp_path)
    config = run_config(resolved)
    # The resolved config's own `planner` section (target GPU) and the prediction must not collide.
    assert "gpu" in config["planner"]
    assert config["planner_prediction"]["memory"]["tensors_gib"] > 0


# A run of each objective as its rows carry it: what the end of the run is judged by comes from these keys.
_JUDGED_RUNS = {
    "grpo": (
        {"loss": -0.01, "reward": 0.1, "reward_std": 0.3, "kl": 0.0, "clip_ratio": 0.0},
        {"reward": 0.9},
    ),
    "dpo": (
        {"loss": 0.69, "rewards/accuracies": 0.5, "rewards/margins": 0.0, "rewards/chosen": 0.0},
        {"loss": 0.2, "rewards/accuracies": 1.0, "rewards/margins": 2.5},
    ),
    "kto": ({"loss": 0.5, "kl": 0.0, "rewards/margins": 0.0}, {"kl": 0.4, "rewards/margins": 0.3}),
    "sft": ({"loss": 4.0}, {"loss": 2.0}),
}


def _judged_rows(objective: str) -> list[dict[str, Any]]:
    """10 steps: the first 5 with the first values, the last 5 with the second's changes."""
    first, last = _JUDGED_RUNS[objective]
    return [{**_step_metrics(s), **first, **(last if s > 5 else {})} for s in range(1, 11)]


_WINDOW = "mean of the first -> last 5 step(s) │"


@pytest.mark.parametrize(
    ("objective", "closing", "table_rows"),
    [
        ("grpo", "reward 0.1000 -> 0.9000", [f"reward, {_WINDOW} 0.1000 -> 0.9000"]),
        (
            "dpo",
            "reward accuracy 0.5000 -> 1.0000, reward margin 0.0000 -> 2.5000",
            [
                f"reward accuracy (rewards/accuracies), {_WINDOW} 0.5000 -> 1.0000",
                f"reward margin (rewards/margins), {_WINDOW} 0.0000 -> 2.5000",
            ],
        ),
        ("kto", "KL 0.0000 -> 0.4000", [f"KL (kl), {_WINDOW} 0.0000 -> 0.4000"]),
        ("sft", "loss 4.0000 -> 2.0000", []),  # the loss rows say it
    ],
)
def test_the_end_of_a_run_shows_what_its_objective_is_judged_by(
    objective: str, closing: str, table_rows: list[str]
) -> None:
    """GRPO's closing line and summary show the reward (its on-policy loss is ~0 by construction), a
    preference run's the reward accuracy and margin, KTO's the KL, SFT's the loss: read from the metrics the
    rows carry (`keys.JUDGED_BY`), never from the objective's name. The table shows them first, then the
    loss rows; summary.json's `judged_by` holds the same figures."""
    rows = _judged_rows(objective)
    trends = judged_trends(judged_series(rows))
    assert describe_trends(trends) == f"{closing} (mean of the first / last 5 steps)"
    buffer = io.StringIO()
    sink = ConsoleSink(10, console=Console(file=buffer, force_terminal=False, width=160))
    for step, row in enumerate(rows, 1):
        sink.log(step, row)
    sink.close()
    table = [" ".join(line.strip("│ ").split()) for line in buffer.getvalue().splitlines() if "│" in line]
    assert table[1 : 1 + len(table_rows)] == table_rows
    assert table[1 + len(table_rows)].startswith("loss, mean of the last 5 step(s) │ ")
    judged = sink.summary.result()["judged_by"]
    assert judged == {t.key: {"first": t.first, "last": t.last, "steps": 5} for t in trends}
