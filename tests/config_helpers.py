"""Configs and one-process engines for in-process tests, built the way a run builds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerofit.config import ZerofitConfig, load_config
from zerofit.config.loader import validate_config
from zerofit.engine_spec import LocalSpec, render_spec
from zerofit.engine_spec.run_plan import RunPlan, make_run_plan
from zerofit.resolution import ResolvedConfig, resolve
from zerofit.strategies.env import LaunchEnv
from zerofit.strategies.single import SingleStrategy

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = str(REPO / "data" / "demo.jsonl")


def config(base: dict[str, Any], **sections: dict[str, Any]) -> ZerofitConfig:
    """`base` (a raw config dict) with each keyword section merged into its section, validated as a loaded
    config is (a bad value is a `ConfigError` naming the key)."""
    raw = {name: dict(values) if isinstance(values, dict) else values for name, values in base.items()}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return validate_config(raw)


def one_process_spec(precision: str = "fp32") -> LocalSpec:
    """The engine spec of a plain one-process run (`distributed.strategy=single`) at `precision`."""
    cfg = load_config(
        None,
        [
            "distributed.strategy=single",
            f"train.precision={precision}",
            "batch.global_batch_size=1",
            "batch.micro_batch_size=1",
            f"data.path={DEMO_DATA}",
        ],
    )
    spec = render_spec(resolve(cfg, 1))
    assert isinstance(spec, LocalSpec)
    return spec


def one_process_strategy(precision: str = "fp32") -> SingleStrategy:
    """A `SingleStrategy` for rank 0 of 1 (no process group), not yet prepared."""
    return SingleStrategy(LaunchEnv(0, 1, 0, False), one_process_spec(precision))


def prepared_one_process_strategy(width: int = 3) -> SingleStrategy:
    """`one_process_strategy()` prepared with a `width` x `width` linear layer, AdamW and a constant schedule:
    enough engine state for checkpoint tests that need no real model."""
    import torch

    strategy = one_process_strategy()
    strategy.prepare(
        torch.nn.Linear(width, width),
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.1),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    return strategy


def new_run_plan(resolved: ResolvedConfig) -> RunPlan:
    """The run plan of a new run of `resolved` (no checkpoint, no data loaded), as the probe makes it."""
    return make_run_plan(resolved, render_spec(resolved))


def train_demo(root: Path, steps: int, **train: Any) -> Path:
    """The demo config (tiny-llama, LoRA) trained for `steps` on one process under `root` as run `demo`, its
    `train` section updated by `train` (console and W&B off); returns the run directory (final export
    adapter/ and a checkpoint of the last step)."""
    import zerofit

    zerofit.train(
        str(REPO / "configs" / "demo.yaml"),
        output_dir=str(root / "runs"),
        run_name="demo",
        distributed={"strategy": "single", "preset": None},
        train={"max_steps": steps, **train},
        data={"path": DEMO_DATA},
        logging={"console": False, "wandb": {"mode": "disabled"}},
    )
    return root / "runs" / "demo"
