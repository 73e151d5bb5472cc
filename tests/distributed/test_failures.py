"""Failures a long run meets end cleanly on every rank (real 2-rank `deepspeed` launches, gloo on CPU):

- a full disk mid-checkpoint: one paragraph on every rank (folder, free space, what was kept, the fix), no
  traceback (W&B's included), the partial folder removed, and no rank left waiting in a barrier;
- the `deepspeed` runner killed alone: its `launch.py` and both ranks stop instead of training on unwatched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from full_disk import small_filesystem
from launch_helpers import Launch, run_one, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


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


def test_a_full_disk_mid_checkpoint_is_one_paragraph_on_every_rank(config: Path) -> None:
    # 400 KiB holds the run's small files but not a checkpoint (~650 KiB on DeepSpeed ZeRO-2 here).
    with small_filesystem(config.parent / "disk", 400) as disk:
        launch = Launch("full", "deepspeed", (f"output_dir={disk}",))
        result = run_one(launch, config, config.parent / "runs", timeout=300)
        leftovers = sorted(p.name for p in (disk / "full" / "checkpoints").iterdir())
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    for rank in (0, 1):
        paragraph = f"zerofit (rank {rank}): error: checkpoint step-2 could not be written in {disk / 'full'}"
        assert paragraph in out, out[-3000:]
    assert "No space left on device" in out and "free of 400.0 KiB" in out
    assert "Kept: no checkpoint" in out and "the partial step-2.tmp was removed" in out
    assert "Traceback" not in out and "Logging error" not in out, out[-3000:]
    assert leftovers == []
