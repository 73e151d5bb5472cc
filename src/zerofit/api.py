"""The Python API: `zerofit.train` and `zerofit.plan`, for notebooks and scripts.

    from zerofit import train, plan
    plan("configs/demo.yaml", world_size=2)["batch"]["formula"]    # 'global 16 = micro 4 x accum 2 x dp 2'
    result = train("configs/demo.yaml", distributed__strategy="single", train={"max_steps": 30})
    result.final_loss, result.eval_loss, result.run_dir, result.metrics[-1]["lr"]

The same config, overrides and checks as the command line (`launchers/launch_finetune.py`, `zerofit plan`):
`train` runs in this process through `zerofit.recipe.run.run_training`, so it trains with the world size of the
launch it is in (one process in a notebook; under torchrun every rank calls it). User errors raise
`zerofit.core.errors.ZerofitError` subclasses (`ConfigError`, `DataError`, `LaunchError`) with the same one
paragraph the command line prints.

Overrides are keyword arguments, in any of three spellings: a dotted key (`**{"train.max_steps": 30}`),
double underscores for dots (`train__max_steps=30`), or a section as a dict (`train={"max_steps": 30}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerofit.config import ZerofitConfig, load_config
from zerofit.config.loader import (
    deep_merge,
    flatten,
    parse_overrides,
    read_config_file,
    refuse_null_run_name,
    validate_config,
)
from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import RunLayout
from zerofit.resolution import resolve

__all__ = ["RunResult", "plan", "train"]

ConfigLike = str | Path | dict[str, Any] | ZerofitConfig


@dataclass
class RunResult:
    """What `train` returns: where the run is, how it ended, and every logged metrics row."""

    run_dir: Path
    final_loss: float | None
    eval_loss: float | None  # the last evaluation's loss (None without evaluation data)
    steps: int  # optimizer steps done (the step of the last metrics row)
    metrics: list[dict[str, Any]] = field(repr=False)  # the rows of metrics.jsonl
    summary: dict[str, Any] = field(repr=False)  # summary.json: losses, tokens, throughput, memory
    export_dir: Path | None = None  # adapter/ or model/ (None with checkpoint.save_final=false)
    config: dict[str, Any] = field(default_factory=dict, repr=False)  # the resolved config (config.yaml)


def _override_items(overrides: dict[str, Any]) -> dict[str, Any]:
    """Keyword overrides as one nested dict (dotted keys, `__` for dots, or whole sections as dicts)."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = key.replace("__", ".").split(".")
        node: dict[str, Any] = {parts[-1]: value}
        for part in reversed(parts[:-1]):
            node = {part: node}
        nested = deep_merge(nested, node)
    return nested


def _config(config: ConfigLike, overrides: dict[str, Any]) -> tuple[ZerofitConfig, str | None]:
    """The validated config and, for a file, its path (it names the W&B group, as on the command line).

    The keyword overrides count as the command line's do (`ZerofitConfig.overridden`): e.g.
    `distributed__strategy="single"` over a file with a DeepSpeed preset drops the preset, as
    `distributed.strategy=single` on the command line does, rather than contradicting it.
    """
    extra = _override_items(overrides)
    refuse_null_run_name(extra)
    if isinstance(config, ZerofitConfig):
        cfg, path = validate_config(deep_merge(config.model_dump(mode="json"), extra)), None
    elif isinstance(config, dict):
        cfg, path = validate_config(deep_merge(config, extra)), None
    elif isinstance(config, (str, Path)):
        loaded = load_config(config)
        cfg = validate_config(deep_merge(loaded.model_dump(mode="json", exclude_unset=True), extra))
        path = str(config)
    else:
        raise ConfigError(
            [f"config must be a YAML path, a dict or a ZerofitConfig, got {type(config).__name__}"]
        )
    cfg.mark_overridden(frozenset(flatten(extra)))
    return cfg, path


def plan(
    config: ConfigLike,
    *,
    world_size: int = 1,
    gpu: str | None = None,
    gpu_mem: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """What `zerofit plan --json` prints, as a dict: batch split, engine config, run dir, memory verdict.

    `world_size`: the data-parallel ranks to plan for; `gpu` (e.g. `rtx3090`) or `gpu_mem` (`24GiB`): the
    card the memory verdict is for. Nothing is loaded or launched.
    """
    from zerofit.commands.plan import build_plan_report, default_device
    from zerofit.engine_spec import render_spec
    from zerofit.planner import choose_fastest_plan
    from zerofit.planner.plan_report import check_gpu_options

    check_gpu_options(gpu, gpu_mem)
    cfg, _ = _config(config, overrides)
    targets = []
    if gpu is not None:
        targets.append(f"planner.gpu={gpu}")
    if gpu_mem is not None:
        from zerofit.catalogue.gpus import parse_memory_gib

        targets.append(f"planner.gpu_memory_gib={parse_memory_gib(gpu_mem)}")
    if targets:
        targeted = validate_config(deep_merge(cfg.model_dump(mode="json"), parse_overrides(targets)))
        targeted.mark_overridden(cfg.overridden)
        cfg = targeted
    resolved = resolve(cfg, world_size, choose_fastest_plan)
    spec = render_spec(resolved, default_device())  # as `zerofit plan`'s default

    return build_plan_report(resolved, spec, gpu=gpu, gpu_mem=gpu_mem)


def train(config: ConfigLike, **overrides: Any) -> RunResult:
    """Train the run `config` describes (a YAML path, a dict or a `ZerofitConfig`), with `overrides`.

    Runs in this process and returns when training (and the final export) is done; the process is left
    as it was found (no process group, no rendezvous variables), so another call or library can follow.
    """
    from zerofit.recipe.run import resolve_for_launch, run_training
    from zerofit.strategies.env import launch_env, rendezvous_restored

    cfg, config_path = _config(config, overrides)
    with rendezvous_restored():
        outcome = run_training(resolve_for_launch(cfg, launch_env()), config_path)
    return read_result(outcome.run_dir, outcome.export_dir)


def read_result(run_dir: str | Path, export_dir: Path | None = None) -> RunResult:
    """A finished run directory as a `RunResult` (what `train` returns for the run it just did)."""
    from zerofit.metrics.runs import load_run

    run_dir = Path(run_dir)
    loaded = load_run(run_dir)
    summary = loaded.summary()
    saved = RunLayout(run_dir).summary
    if saved.is_file():
        summary = {**summary, **json.loads(saved.read_text())}
    config_file = RunLayout(run_dir).config
    return RunResult(
        run_dir=run_dir,
        final_loss=summary.get("final_loss"),
        eval_loss=summary.get("eval_loss"),
        steps=int(summary.get("steps") or 0),
        metrics=loaded.rows,
        summary=summary,
        export_dir=export_dir,
        config=read_config_file(config_file) if config_file.is_file() else {},
    )
