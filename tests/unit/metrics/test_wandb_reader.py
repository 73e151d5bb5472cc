"""Reading a W&B offline run file back without network: history, config, summary, block format."""

from __future__ import annotations

from pathlib import Path

import pytest

from config_helpers import new_run_plan
from zerofit.config.schema import ZerofitConfig
from zerofit.metrics.wandb_reader import (
    BLOCK_SIZE,
    WandbFileError,
    find_run_file,
    iter_record_bytes,
    read_table,
    read_wandb_run,
)
from zerofit.metrics.wandb_sink import STEP_METRIC, TOKENS_METRIC, WandbSink
from zerofit.resolution import resolve

STEPS = 30
TABLE_STEP = 10
TABLE_ROWS = [
    {
        "step": TABLE_STEP,
        "prompt": "add: 1+2\n",
        "completion": "3",
        "reward": 1.5,
        "rewards/exact_match": 1.0,
    },
    {
        "step": TABLE_STEP,
        "prompt": "add: 1+2\n",
        "completion": "The",
        "reward": 0.0,
        "rewards/exact_match": 0.0,
    },
]


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, float]]]:
    """One offline run with a config larger than a 32 KiB block (records split across blocks)."""
    root = tmp_path_factory.mktemp("wandb")
    data = root / "data.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    cfg = ZerofitConfig(output_dir=str(root / "runs"))
    cfg.data.path = str(data)
    cfg.batch.global_batch_size = 8
    cfg.batch.micro_batch_size = 2
    cfg.logging.wandb.mode = "offline"
    sink = WandbSink(new_run_plan(resolve(cfg, 2)), notice=lambda _: None, key_configured=True)
    sink.log_config({"batch_plan": {"micro_batch_size": 2, "dp_size": 2}, "blob": "x" * (3 * BLOCK_SIZE)})
    logged = []
    for step in range(1, STEPS + 1):
        row = {
            "loss": 3.0 / step + 1e-9 * step,
            "lr": 1e-3 * step,
            "tokens": 40,
            "tokens_per_s": 123.25,
            "mem/source": "cpu_rss",
            "mem/rank0/peak_gib": 0.5,
            "mem/rank1/peak_gib": 0.75,
        }
        if step == TABLE_STEP:  # GRPO's sampled completions, as the loop hands them over (before the row)
            sink.log_table(step, "completions", TABLE_ROWS)
        sink.log(step, row)
        logged.append(row)
    sink.close()
    return root / "runs", logged


def test_history_equals_what_was_logged(offline_run: tuple[Path, list[dict[str, float]]]) -> None:
    runs_dir, logged = offline_run
    run = read_wandb_run(find_run_file(runs_dir))
    assert sorted(run.history) == list(range(1, STEPS + 1))
    for step, row in zip(range(1, STEPS + 1), logged, strict=True):
        got = run.history[step]
        assert got["loss"] == row["loss"]  # exact: the float survives the round trip
        assert got["lr"] == row["lr"]
        assert got[STEP_METRIC] == step
        assert got[TOKENS_METRIC] == 40 * step
        assert got["mem/rank1/peak_gib"] == 0.75
    assert "mem/source" not in run.history[1]  # labels go to the summary, not history
    assert run.summary["mem/source"] == "cpu_rss"


def test_a_table_reads_back_as_its_rows(offline_run: tuple[Path, list[dict[str, float]]]) -> None:
    """`WandbSink.log_table` writes a wandb.Table at its step, in the same history row as that step's
    metrics (GRPO's completions table: docs/guides/rl.md)."""
    run = read_wandb_run(find_run_file(offline_run[0]))
    assert read_table(run, "completions", TABLE_STEP) == TABLE_ROWS
    assert run.history[TABLE_STEP]["loss"] == offline_run[1][TABLE_STEP - 1]["loss"]
    assert [s for s, _ in run.series("completions/_type")] == [TABLE_STEP]
    with pytest.raises(KeyError, match="no table 'completions' at step 11"):
        read_table(run, "completions", TABLE_STEP + 1)


def test_config_and_summary_read_back(offline_run: tuple[Path, list[dict[str, float]]]) -> None:
    run = read_wandb_run(offline_run[0])
    assert run.config["batch_plan"] == {"micro_batch_size": 2, "dp_size": 2}
    assert len(run.config["blob"]) == 3 * BLOCK_SIZE  # a record spanning several blocks
    assert run.summary["summary/final_loss"] == pytest.approx(0.1, abs=1e-6)
    assert run.summary["summary/peak_gib_rank1"] == 0.75
    assert run.group == "tiny-llama-lora-zero2-bf16" and run.name == "zero2-g8-m2x2x2"


def test_corrupt_file_is_detected(offline_run: tuple[Path, list[dict[str, float]]], tmp_path: Path) -> None:
    data = bytearray(find_run_file(offline_run[0]).read_bytes())
    data[40] ^= 0xFF  # flip a payload byte of the first record
    bad = tmp_path / "run-bad.wandb"
    bad.write_bytes(bytes(data))
    with pytest.raises(WandbFileError, match="checksum"):
        list(iter_record_bytes(bad))
    not_wandb = tmp_path / "run-x.wandb"
    not_wandb.write_bytes(b"hello world, not a wandb file")
    with pytest.raises(WandbFileError, match="not a W&B run file"):
        list(iter_record_bytes(not_wandb))


def test_torn_tail_is_ignored(offline_run: tuple[Path, list[dict[str, float]]], tmp_path: Path) -> None:
    data = find_run_file(offline_run[0]).read_bytes()
    torn = tmp_path / "run-torn.wandb"
    torn.write_bytes(data[: len(data) - 5])  # a crash mid-write
    assert (
        0 < len(list(iter_record_bytes(torn))) < len(list(iter_record_bytes(find_run_file(offline_run[0]))))
    )
