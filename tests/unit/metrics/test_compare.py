"""`zerofit compare` on two synthetic runs: tables, valid PNGs with the expected series, W&B-only runs."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from metrics_fixtures import make_run

from config_helpers import new_run_plan
from zerofit.cli import main
from zerofit.metrics.compare import (
    config_differences,
    plot_runs,
    smoothing_window,
    style_axes,
    trailing_mean,
)
from zerofit.metrics.runs import load_run
from zerofit.metrics.wandb_sink import WandbSink

PLOTS = ("loss_vs_step.png", "loss_vs_tokens.png", "peak_memory_per_rank.png", "tokens_per_s.png")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    a = make_run(tmp_path, "run-a", preset="zero2", micro=4, peaks=(1.0, 1.5), tokens_per_s=1000.0)
    b = make_run(tmp_path, "run-b", preset="zero3", micro=2, peaks=(0.8, 0.9), tokens_per_s=700.0)
    return a, b


def test_compare_prints_tables_and_writes_plots(
    two_runs: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    out = tmp_path / "cmp"
    assert main(["compare", str(two_runs[0]), str(two_runs[1]), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    # The config table shows only what differs: preset and split, not the shared precision.
    assert "distributed.preset" in text and "zero3" in text
    assert "g16-m4x2x2" in text and "g16-m2x4x2" in text
    assert "train.precision=bf16" in text  # named as held fixed, in the caption
    # Outcomes: final loss, per-rank peaks, throughput (mean leaves out warm-up step 1).
    assert "0.5000" in text and "1.560 GiB" in text and "0.860 GiB" in text
    assert "1,004.0" in text and "704.0" in text
    report = json.loads((out / "compare.json").read_text())
    assert report["config_differences"]["distributed.preset"] == ["zero2", "zero3"]
    for name in PLOTS:
        width, height = _png_size(out / name)
        assert (width, height) == (640, 400)
        assert str(out / name) in text
    assert report["plots"][str(out / "peak_memory_per_rank.png")] == [
        "run-a rank0",
        "run-a rank1",
        "run-b rank0",
        "run-b rank1",
    ]
    assert report["plots"][str(out / "loss_vs_step.png")] == ["run-a", "run-b"]


def test_plot_series_hold_the_logged_values(two_runs: tuple[Path, Path]) -> None:
    runs = [load_run(p) for p in two_runs]
    xs, ys = runs[1].series("loss", x="tokens_seen")
    assert xs == [100.0 * s for s in range(1, 7)]
    assert ys == pytest.approx([3.0 / s for s in range(1, 7)])
    assert runs[0].ranks() == [0, 1]


def test_identical_configs_have_no_differences(tmp_path: Path) -> None:
    runs = [load_run(make_run(tmp_path, name)) for name in ("x", "y")]
    diffs, same = config_differences(runs)
    assert diffs == []
    assert "distributed.preset=zero2" in same


@pytest.mark.slow
def test_compare_reads_wandb_offline_when_metrics_jsonl_is_absent(tmp_path: Path) -> None:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.resolution import resolve

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = ZerofitConfig(output_dir=str(tmp_path / "runs"), run_name="wb-only")
    cfg.data.path = str(data)
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 8, 4
    cfg.logging.wandb.mode = "offline"
    resolved = new_run_plan(resolve(cfg, 1))
    sink = WandbSink(resolved, notice=lambda _: None, key_configured=True)
    sink.log_config(resolved.config.model_dump(mode="json"))
    for step in (1, 2, 3):
        sink.log(step, {"loss": 1.0 / step, "tokens": 10, "tokens_per_s": 5.0, "mem/rank0/peak_gib": 0.25})
    sink.close()
    run = load_run(resolved.run_dir)
    assert run.source == "wandb"
    assert [r["step"] for r in run.rows] == [1, 2, 3]
    assert run.config["run_name"] == "wb-only"
    assert run.summary()["final_loss"] == pytest.approx(1 / 3)
    written = plot_runs([run], tmp_path / "out")
    assert written[tmp_path / "out" / "peak_memory_per_rank.png"] == ["wb-only rank0"]


def test_missing_run_dir_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compare", str(empty)]) == 2
    shutil.rmtree(empty)


def test_compare_shows_a_preference_runs_rewards(
    two_runs: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DPO run's TRL-named metrics (rewards/*, logps/*) reach the outcome table and a plot."""
    monkeypatch.setenv("COLUMNS", "160")
    dpo = two_runs[0] / "metrics.jsonl"
    rows = [json.loads(line) for line in dpo.read_text().splitlines()]
    for row in rows:
        row.update({"rewards/accuracies": 0.125 * row["step"], "rewards/margins": 0.5, "logps/chosen": -12.0})
    dpo.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "cmp"
    assert main(["compare", str(two_runs[0]), str(two_runs[1]), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    (accuracy,) = [line for line in text.splitlines() if "final rewards/accuracies" in line]
    assert "0.7500" in accuracy and "-" in accuracy.split("0.7500")[1]  # the SFT run has none
    assert "final logps/chosen" in text and "-12.0000" in text
    assert _png_size(out / "rewards_accuracies_vs_step.png") == (640, 400)


def test_short_runs_get_whole_step_ticks_and_a_readable_legend() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.plot([1, 2, 3, 4, 5], [3.0, 2.5, 2.2, 2.1, 2.0], label="zero2")
    style_axes(ax, integer_x=True)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 5]
    assert ticks and all(float(t).is_integer() for t in ticks)  # not 1.5, 2.5, ... on a 5-step run
    legend = ax.get_legend()
    assert legend is not None and min(t.get_fontsize() for t in legend.get_texts()) >= 9
    plt.close(fig)


def test_throughput_is_smoothed_with_the_raw_values_kept_faint(tmp_path: Path) -> None:
    assert smoothing_window(10) == 1 and smoothing_window(300) == 20
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    run = load_run(make_run(tmp_path, "long", steps=60, tokens_per_s=1000.0))
    written = plot_runs([run], tmp_path / "out")
    assert written[tmp_path / "out" / "tokens_per_s.png"] == ["long"]  # the faint raw series: no legend entry


def test_compare_without_out_writes_into_the_first_run_not_the_working_tree(
    two_runs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["compare", str(two_runs[0]), str(two_runs[1])]) == 0
    assert not list(work.iterdir())  # nothing left in the working directory
    (out,) = two_runs[0].glob("compare-*")
    assert (out / "compare.json").is_file() and (out / "tokens_per_s.png").is_file()


def test_compare_shows_a_kto_runs_reference_point(
    two_runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KTO run's `kl` and `eval/kl` (z0, `zerofit.objectives.kto.loss`) reach the outcome table."""
    monkeypatch.setenv("COLUMNS", "160")
    kto = two_runs[0] / "metrics.jsonl"
    rows = [json.loads(line) for line in kto.read_text().splitlines()]
    for row in rows:
        row.update({"kl": 0.25 * row["step"], "eval/kl": 0.0625, "rewards/chosen": 0.5})
    kto.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["compare", str(two_runs[0])]) == 0
    text = capsys.readouterr().out
    (kl,) = [line for line in text.splitlines() if "final kl " in line]
    assert f"{0.25 * rows[-1]['step']:.4f}" in kl
    assert "final eval/kl" in text and "0.0625" in text


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (b'{"step": "x", "loss": 1.0}', "line 3: its step is 'x', not a whole number >= 1"),
        (b"\xff\xfe\x00garbage", "line 3: not UTF-8 text (byte 0xff at column 1)"),
        (b'{"step": 2, "loss": ', "line 3: not valid JSON"),
    ],
    ids=["step-not-a-number", "not-utf8", "torn-mid-file"],
)
def test_a_line_that_is_no_row_is_named_skipped_and_the_rest_compared(
    two_runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], bad: bytes, why: str
) -> None:
    metrics = two_runs[1] / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines()
    metrics.write_bytes(b"\n".join([*lines[:2], bad, *lines[2:]]) + b"\n")
    assert main(["compare", str(two_runs[0]), str(two_runs[1]), "--no-plots"]) == 0
    out, err = capsys.readouterr()
    (warning,) = err.splitlines()  # one line, naming the file and the line
    assert warning.startswith(f"zerofit: warning: {metrics}: skipped 1 line") and why in warning
    assert "Traceback" not in err
    (steps,) = [line for line in out.splitlines() if "optimizer steps" in line]
    assert [cell.strip() for cell in steps.split("│")[2:4]] == ["6", "6"]  # both runs: all 6 steps compared
    assert [row["step"] for row in load_run(two_runs[1]).rows] == [1, 2, 3, 4, 5, 6]


def test_a_metrics_file_with_no_usable_line_is_one_paragraph_naming_it(
    two_runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = two_runs[1] / "metrics.jsonl"
    random = bytes((i * 197 + 61) % 256 for i in range(4000))  # bytes of every value, newlines included
    metrics.write_bytes(random)
    assert main(["compare", str(two_runs[0]), str(two_runs[1]), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zerofit compare: error: {metrics} holds no usable metrics row (line 1: ")
    assert err.count("\n") == 1 and "Traceback" not in err
    metrics.write_text('{"step": "x"}\n["a list"]\n')
    assert main(["compare", str(two_runs[1]), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "line 1: its step is 'x', not a whole number >= 1; line 2: a JSON list, not an object" in err
