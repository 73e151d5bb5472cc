"""The run plan: everything a launch decided, made once, in one place, and never replaced afterwards.

A launch decides in two stages, because the second needs the process group and the data:

1. `resolve(config, world_size, choose_plan)` (`config/resolve.py`) decides what the config alone decides:
   the engine and preset, the exact batch split (and the planner's choice for every `auto` key), the W&B
   mode, the asked run name and directory. `zerofit plan` and the planner's what-ifs stop here.
2. `make_run_plan` (here, called once by `zerofit.recipe.assembly.assemble`) adds what only the launch can know:
   the run directory as rank 0 found it on disk (a new run never touches an existing one: `-2`, `-3`, ...)
   and the checkpoint it resumes from (`checkpoint/resume.settle_run_dir`), and what the data decides
   (`data.format: auto` -> the detected format, `train.epochs` -> the exact `train.max_steps`).

The result is a frozen `RunPlan` holding the final config (no `auto` left, the run name as settled): what
`config.yaml`, every checkpoint manifest, W&B and the plan print all record. Nothing builds a `RunPlan`
anywhere else, and nothing changes one (`tests/unit/engine_spec/test_run_plan.py` holds the code to both).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from zerofit.config.batching import BatchSplit
from zerofit.config.schema import ZerofitConfig
from zerofit.core.run_layout import run_dir_of
from zerofit.resolution import ResolvedConfig

if TYPE_CHECKING:
    from zerofit.engine_spec.spec import EngineSpec
    from zerofit.objectives.spec import ObjectiveSpec

__all__ = ["DataFacts", "ResumePoint", "RunDirDecision", "RunPlan", "make_run_plan"]


@dataclass(frozen=True)
class ResumePoint:
    """The verified checkpoint a launch resumes from, and what the user should be told about it."""

    folder: Path
    step: int
    world_size: int  # ranks that saved it
    elapsed_s: float  # wall time of the run up to this checkpoint
    tokens_seen: int | None = None  # valid label tokens of its steps (None: a manifest older than the field)
    notes: tuple[str, ...] = ()  # fallbacks, accepted and neutral changes, elastic resume
    damaged: tuple[Path, ...] = ()  # newer checkpoints that failed verification (set aside after the load)


@dataclass(frozen=True)
class RunDirDecision:
    """Rank 0's decision for every rank: the run name (the asked one, or the first free `-N` of a new run
    whose directory already holds a run) and the checkpoint to resume from (None: start at step 0)."""

    run_name: str
    resume: ResumePoint | None = None
    note: str | None = None  # why the name is not the asked one (`rundir.taken_note`), for the plan


@dataclass(frozen=True)
class DataFacts:
    """What the loaded training data decides: its format (the detected one under `data.format: auto`) and
    the optimizer steps of one epoch (the sampler's last-window rule), which a `train.epochs` run needs."""

    format: str
    steps_per_epoch: int


# The token only `make_run_plan` passes: a RunPlan built anywhere else, or copied with changes
# (`dataclasses.replace` passes the InitVar's default, None), is refused when it is constructed.
_MADE_HERE = object()


@dataclass(frozen=True)
class RunPlan:
    """One launch's every decision: the final config, the batch split, the engine spec, the run directory,
    the resume point. Frozen, and built only by `make_run_plan` (anything else raises `TypeError`)."""

    config: ZerofitConfig  # no `auto` left; the run name as settled; what config.yaml records
    objective: ObjectiveSpec  # train.objective's spec, as the resolution decided it
    batch: BatchSplit
    spec: EngineSpec
    world_size: int
    run_dir: Path
    resume: ResumePoint | None
    effective_lr: float  # optimizer.lr after the opt-in scaling with the global batch
    method: str  # full, lora, qlora or lora-8bit
    notes: tuple[str, ...] = ()  # what resolve() decided that the user did not literally write
    maker: InitVar[object] = None

    def __post_init__(self, maker: object) -> None:
        if maker is not _MADE_HERE:
            raise TypeError(
                "a RunPlan is made once, by zerofit.engine_spec.run_plan.make_run_plan, and never rebuilt or copied with "
                "changes: pass what the launch decided to make_run_plan instead"
            )

    @property
    def run_name(self) -> str:
        """The run's name: the last part of `run_dir`."""
        return str(self.config.run_name)


def make_run_plan(
    resolved: ResolvedConfig,
    spec: EngineSpec,
    decision: RunDirDecision | None = None,
    data: DataFacts | None = None,
) -> RunPlan:
    """The run plan of `resolved` as launched: `decision` from `settle_run_dir` (None: a new run at the
    resolved run directory, the probe's and the benchmarks' case), `data` from the loaded data (None: a
    synthetic-batch run, which loads none and must set `train.max_steps`)."""
    cfg = resolved.config.model_copy(deep=True)  # the resolved config stays as resolve() made it
    if decision is not None:
        cfg.run_name = decision.run_name
    if data is not None and cfg.data.format == "auto":
        cfg.data.format = data.format  # type: ignore[assignment]
    if cfg.train.max_steps is None:
        # resolve() leaves max_steps open only for train.epochs: epochs x steps per epoch, known from the data.
        if data is None or cfg.train.epochs is None:
            raise ValueError("a train.epochs run is planned with its data (DataFacts)")
        cfg.train.max_steps = cfg.train.epochs * data.steps_per_epoch
    return RunPlan(
        config=cfg,
        objective=resolved.objective,
        batch=resolved.batch,
        spec=spec,
        world_size=resolved.world_size,
        run_dir=run_dir_of(cfg.output_dir, str(cfg.run_name)),
        resume=decision.resume if decision is not None else None,
        effective_lr=resolved.effective_lr,
        method=resolved.method,
        notes=resolved.notes + ((decision.note,) if decision is not None and decision.note else ()),
        maker=_MADE_HERE,
    )
