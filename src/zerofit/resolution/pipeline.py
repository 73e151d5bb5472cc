"""`resolve()`: check a whole config against the launch, collect every problem, derive every value.

A short sequence of named steps (`resolve` reads top to bottom): turn `train.objective` into its spec (once:
`ResolvedConfig.objective`), settle the engine, check the engine, what the objective fixes of the batch, the
batch (solved here unless the micro-batch is `auto`), the training keys, the run length, quantization, the
data, the objective's own rules and the model; then, only when none of them found a problem, let the plan
chooser decide the `auto` keys (`choose`: its candidates are resolved by this very function, so a problem
elsewhere must not reach it); then fill the batch, the W&B mode, what the objective left `auto` and the run
directory. The rules live by area in `zerofit.config.rules` (engine, batch, data, model, training) and in the
objective's slice (`zerofit.objectives`); bounds of single values are constraints on the schema's fields,
checked (and worded) when the config is validated (`zerofit.config.loader`).

After `resolve()` nothing is left for later layers to guess: the batch triple is exact for the launcher's
world size, the preset and W&B mode are concrete, the run name and run directory are fixed.
`auto` (`batch.micro_batch_size`, `batch.tokens_per_micro_batch`, `train.activation_checkpointing`,
`train.tiled_mlp`, `train.activation_offload`, `train.lean_norm`, `train.cross_entropy`) is decided here
too, by the plan chooser the caller passes in (the memory planner's, `zerofit.planner.choose_fastest_plan`):
the resolution sits below the planner and never imports it. A token budget (`batch.tokens_per_micro_batch`)
is a micro-batch of packed rows: tokens / max_seq_len rows, which is what `batch.micro_batch_size` holds
after `resolve()`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from zerofit.config.batching import BatchSplit
from zerofit.config.rules.batch import PlanChooser, check_batch, choose, fill_batch
from zerofit.config.rules.data import check_data
from zerofit.config.rules.engine import check_engine, check_sequence_parallel, settle_engine
from zerofit.config.rules.model import (
    adaptation_method,
    check_attention,
    check_kernels,
    check_model_and_loss,
    check_quantization,
    fill_attention,
    fill_kernels,
)
from zerofit.config.rules.training import check_length, check_training, fill_logging, fill_run_dir
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.objectives.registry import objective_of
from zerofit.objectives.spec import ObjectiveSpec

__all__ = ["ResolvedConfig", "resolve"]


@dataclass(frozen=True)
class ResolvedConfig:
    """A config with every derived value filled, plus its objective, the batch plan and run directory."""

    config: ZerofitConfig
    objective: ObjectiveSpec  # train.objective's spec: what every later layer asks about the objective
    batch: BatchSplit
    world_size: int
    run_dir: Path
    # What resolve() decided that the user did not literally write (an engine switch), for the plan to say.
    notes: tuple[str, ...] = ()

    @property
    def effective_lr(self) -> float:
        """`optimizer.lr` after the opt-in scaling with the global batch (`optimizer.lr_scaling`)."""
        opt = self.config.optimizer
        if opt.lr_scaling == "none" or opt.base_batch_size is None:
            return opt.lr
        ratio = self.batch.global_batch_size / opt.base_batch_size
        return opt.lr * (ratio if opt.lr_scaling == "linear" else math.sqrt(ratio))

    @property
    def method(self) -> str:
        """How the model is adapted (`full`, `lora`, `qlora`, `lora-8bit`)."""
        return adaptation_method(self.config)


def resolve(config: ZerofitConfig, world_size: int, choose_plan: PlanChooser | None = None) -> ResolvedConfig:
    """Validate `config` for a launch of `world_size` ranks and fill every derived value.

    `choose_plan` (the planner's chooser, `choose_fastest_plan`) decides every `auto` key (without one,
    `auto` is refused), and is asked only once every check passed (it resolves its candidates with this
    function, without a chooser). Raises one `ConfigError` listing every problem found.
    """
    cfg = config.model_copy(deep=True)
    objective = objective_of(cfg)
    explain = functools.partial(objective.batch_problem, cfg)
    problems: list[str] = []
    notes = settle_engine(cfg)
    check_engine(problems, cfg, world_size)
    check_sequence_parallel(problems, cfg, world_size, objective.sequence_parallel)
    objective.settle_batch(cfg, problems)  # before the batch: GRPO's global batch is its completions
    plan = check_batch(cfg, world_size, choose_plan, problems, explain)
    check_training(problems, cfg)
    check_length(problems, cfg)
    check_quantization(problems, cfg)
    check_data(problems, cfg)
    objective.check(cfg, problems)
    check_model_and_loss(problems, cfg)
    check_attention(problems, cfg)
    check_kernels(problems, cfg)
    if problems:
        raise ConfigError(problems)
    notes += fill_kernels(cfg)
    loss_auto = cfg.train.cross_entropy == "auto"
    plan, choice = choose(cfg, world_size, choose_plan, plan, explain)
    fill_batch(cfg, plan, choice)
    if loss_auto:  # the plan says what auto became (config.yaml records it)
        notes.append(
            f"train.cross_entropy auto -> {cfg.train.cross_entropy}: {choice.loss_reason if choice else ''}"
        )
    fill_attention(cfg)
    fill_logging(cfg)
    objective.fill(cfg)
    run_dir = fill_run_dir(cfg, plan)
    return ResolvedConfig(cfg, objective, plan, world_size, run_dir, tuple(notes))
