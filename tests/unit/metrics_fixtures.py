"""Synthetic run directories (config.yaml + metrics.jsonl) for the metrics and compare tests."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from zerofit.config.schema import ZerofitConfig


def make_run(
    root: Path,
    name: str,
    *,
    preset: str = "zero2",
    micro: int = 4,
    dp: int = 2,
    steps: int = 6,
    loss0: float = 3.0,
    peaks: tuple[float, ...] = (1.0, 1.5),
    tokens_per_s: float = 1000.0,
) -> Path:
    """A finished-looking run: resolved config.yaml and one metrics.jsonl line per optimizer step."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = ZerofitConfig()
    cfg.run_name = name
    cfg.distributed.preset = preset
    cfg.batch.global_batch_size = 16
    cfg.batch.micro_batch_size = micro
    cfg.batch.grad_accum_steps = 16 // (micro * dp)
    cfg.logging.wandb.mode = "offline"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            row = {
                "step": step,
                "loss": loss0 / step,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens": 100,
                "tokens_per_s": tokens_per_s + step,
                "micro_batch_size": micro,
                "grad_accum_steps": 16 // (micro * dp),
                "dp_size": dp,
                "mem/source": "cpu_rss",
                "mem/max_peak_gib": max(peaks),
            }
            for rank, peak in enumerate(peaks):
                row[f"mem/rank{rank}/allocated_gib"] = peak / 2
                row[f"mem/rank{rank}/reserved_gib"] = peak / 2
                row[f"mem/rank{rank}/peak_gib"] = peak + 0.01 * step
            f.write(json.dumps(row) + "\n")
    return run_dir
