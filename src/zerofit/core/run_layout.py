"""The run directory's layout: the one place every file name of `output_dir/run_name/` is spelled.

docs/contracts.md ("Run directory") is the contract; every module that writes or reads a run directory
(the launcher, the metrics sinks, checkpoints and resume, the final export, `zerofit export` / `compare`,
the Python API) takes its names from here, so a name can change in one place and no reader drifts from
the writer. What is inside a checkpoint's `step-N/` folder is the writing engine's (`zerofit.strategies`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from zerofit.core.errors import ConfigError

__all__ = [
    "ADAPTER_DIR",
    "BASE_MODEL_FILE",
    "BEST_FILE",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "DAMAGED_SUFFIX",
    "ENGINE_FILES",
    "EVAL_DIR",
    "EXPORT_INFO",
    "LOCK_FILE",
    "METRICS_FILE",
    "MLFLOW_RUN_FILE",
    "MODEL_DIR",
    "RUN_INFO_FILE",
    "SAVING_SUFFIX",
    "STEP_DIR_GLOB",
    "SUMMARY_FILE",
    "TENSORBOARD_DIR",
    "WANDB_DIR",
    "WANDB_RUN_ID_FILE",
    "RunLayout",
    "check_run_name",
    "harness_file_name",
    "run_dir_of",
    "run_name_problem",
    "saving_dir_name",
    "step_dir_name",
    "step_of_dir",
]

CONFIG_FILE = "config.yaml"  # the fully resolved config
METRICS_FILE = "metrics.jsonl"  # one JSON row per logged step (docs/contracts.md, metrics.jsonl)
RUN_INFO_FILE = "run_info.json"  # config, batch plan, engine config, planner prediction, versions
SUMMARY_FILE = "summary.json"  # the outcome, written at close
CHECKPOINTS_DIR = "checkpoints"  # step-N/ folders (step-N.tmp/: a save in progress)
BEST_FILE = "best.json"  # checkpoints/best.json: the best evaluation's step and eval/loss
LOCK_FILE = ".zerofit.lock"  # held (flock) by rank 0 of the run writing the directory
ADAPTER_DIR = "adapter"  # the final export of a LoRA run
MODEL_DIR = "model"  # the final export of a full fine-tuning run
# Beside a LoRA adapter (adapter/ and `zerofit export`'s): the base model as a user names it on another
# machine (adapter_config.json's base_model_name_or_path is the path this machine loaded it from).
BASE_MODEL_FILE = "zerofit_base_model.json"
# In every `zerofit export` folder: its marker (source run, kind, config, the files it wrote), written by
# `zerofit.export` and read back by `zerofit.trained` (generate, score).
EXPORT_INFO = "zerofit_export.json"
WANDB_DIR = "wandb"  # W&B's files, unless W&B is disabled
WANDB_RUN_ID_FILE = "zerofit-run-id"  # under wandb/: the W&B run id a resume continues
TENSORBOARD_DIR = "tensorboard"  # TensorBoard's event files (`logging.tensorboard`)
MLFLOW_RUN_FILE = "mlflow_run.json"  # the MLflow run a resume continues (`logging.mlflow`)
EVAL_DIR = "eval"  # lm-eval results: harness-step-N.json (`zerofit eval`, `eval.harness`)

# Under checkpoints/: one folder per saved step, named by `step_dir_name` and read back by `step_of_dir`.
STEP_DIR_PREFIX = "step-"  # step-N/: the complete checkpoint after optimizer step N
SAVING_SUFFIX = ".tmp"  # step-N.tmp/: a save in progress, renamed to step-N/ once its manifest is written
DAMAGED_SUFFIX = ".damaged"  # step-N.damaged/: set aside by a resume (it failed to verify), kept to inspect
STEP_DIR_GLOB = f"{STEP_DIR_PREFIX}*"  # every step folder: complete, being saved or set aside
_STEP_DIR = re.compile(rf"^{re.escape(STEP_DIR_PREFIX)}(\d+)$")


def step_dir_name(step: int) -> str:
    """`step-N`: the name of step N's checkpoint folder (`step_of_dir` reads it back)."""
    return f"{STEP_DIR_PREFIX}{step}"


def saving_dir_name(step: int) -> str:
    """`step-N.tmp`: the folder step N's checkpoint is written into before it is renamed `step-N`."""
    return f"{step_dir_name(step)}{SAVING_SUFFIX}"


def step_of_dir(name: str) -> int | None:
    """N for a complete checkpoint's folder name `step-N`, else None (`step-N.tmp`, `step-N.damaged`, ...)."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def harness_file_name(step: int | None) -> str:
    """`harness-step-N.json`: lm-eval's results on the weights of optimizer step N, under `eval/`
    (`harness-final.json` for a final export whose step the run did not record)."""
    return f"harness-{step_dir_name(step) if step is not None else 'final'}.json"


# What a run name must be, said after the value in every refusal (the schema's, the resolver's, the joins').
RUN_NAME_RULE = (
    "must be one folder name inside output_dir: not empty, not '.' or '..', no '/' or '\\', not an absolute "
    "path, no control characters"
)


def run_name_problem(name: str) -> str | None:
    """Why `name` is not one path component under `output_dir` (the rule and a fix), or None if it is.

    A run name is joined under `output_dir` and written into (config.yaml, metrics.jsonl, checkpoints): a
    name that climbs out (`../victim`), names another place (`/tmp/x`, `a/b`) or is empty (`runs/` itself)
    would write into a folder that is not this run's.
    """
    bad = (
        not name.strip()
        or name in {".", ".."}
        or "/" in name
        or "\\" in name
        or PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    )
    if not bad:
        return None
    return f"{RUN_NAME_RULE}; pick a plain name, e.g. run_name={_plain_name(name)} (output_dir says where runs go)"


def _plain_name(name: str) -> str:
    """A one-component name to suggest for a refused `name`: its path parts joined by `-`."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    joined = "-".join(part for part in parts if part.strip("/."))
    return "".join(c for c in joined if ord(c) >= 32 and ord(c) != 127).strip() or "my-run"


def check_run_name(name: str) -> str:
    """`name` if it is one path component (see `run_name_problem`), else a `ConfigError` naming it."""
    problem = run_name_problem(name)
    if problem is not None:
        raise ConfigError([f"run_name = {name!r}: {problem}"])
    return name


def run_dir_of(output_dir: str | Path, run_name: str) -> Path:
    """`output_dir/run_name`, the run directory, for a run name that stays inside `output_dir` (checked)."""
    return Path(output_dir) / check_run_name(run_name)


# The engine file, exactly what the engine received, by `distributed.strategy`.
ENGINE_FILES = {
    "deepspeed": "ds_config.json",
    "fsdp": "fsdp.json",
    "single": "engine.json",
    "ddp": "engine.json",
}


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory (`root` is `output_dir/run_name`); nothing here touches the disk."""

    root: Path

    @property
    def config(self) -> Path:
        """`config.yaml`: the fully resolved config."""
        return self.root / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        """`metrics.jsonl`: the per-step metrics."""
        return self.root / METRICS_FILE

    @property
    def run_info(self) -> Path:
        """`run_info.json`: what defines the run (config extras, versions, planner prediction)."""
        return self.root / RUN_INFO_FILE

    @property
    def summary(self) -> Path:
        """`summary.json`: the run's outcome."""
        return self.root / SUMMARY_FILE

    @property
    def checkpoints(self) -> Path:
        """`checkpoints/`: the complete `step-N/` checkpoints."""
        return self.root / CHECKPOINTS_DIR

    def checkpoint(self, step: int) -> Path:
        """`checkpoints/step-N/`: the checkpoint of optimizer step `step`."""
        return self.checkpoints / step_dir_name(step)

    @property
    def best(self) -> Path:
        """`checkpoints/best.json`: the best evaluation whose checkpoint is kept."""
        return self.checkpoints / BEST_FILE

    @property
    def lock(self) -> Path:
        """`.zerofit.lock`: the lock rank 0 of the writing run holds."""
        return self.root / LOCK_FILE

    @property
    def adapter(self) -> Path:
        """`adapter/`: the final export of a LoRA run."""
        return self.root / ADAPTER_DIR

    @property
    def model(self) -> Path:
        """`model/`: the final export of a full fine-tuning run."""
        return self.root / MODEL_DIR

    @property
    def wandb(self) -> Path:
        """`wandb/`: W&B's files."""
        return self.root / WANDB_DIR

    @property
    def wandb_run_id(self) -> Path:
        """`wandb/zerofit-run-id`: the W&B run id a resume continues."""
        return self.wandb / WANDB_RUN_ID_FILE

    @property
    def tensorboard(self) -> Path:
        """`tensorboard/`: TensorBoard's event files, one run however often it is resumed."""
        return self.root / TENSORBOARD_DIR

    @property
    def mlflow_run(self) -> Path:
        """`mlflow_run.json`: the MLflow run (its id and experiment id) a resume continues."""
        return self.root / MLFLOW_RUN_FILE

    @property
    def eval_dir(self) -> Path:
        """`eval/`: lm-eval's results, one `harness-step-N.json` per evaluated step."""
        return self.root / EVAL_DIR

    def harness(self, step: int | None) -> Path:
        """`eval/harness-step-N.json`: lm-eval's results on the weights of step `step`."""
        return self.eval_dir / harness_file_name(step)

    def export(self, adapter: bool) -> Path:
        """The final export's folder: `adapter/` (LoRA) or `model/` (full fine-tuning)."""
        return self.adapter if adapter else self.model

    def engine_file(self, strategy: str) -> Path:
        """The engine file of `distributed.strategy` (`ds_config.json`, `fsdp.json`, `engine.json`)."""
        return self.root / ENGINE_FILES[strategy]
