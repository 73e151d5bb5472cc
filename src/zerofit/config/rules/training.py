"""Config rules of the training run: its length and early stopping, the optimizer's keys, W&B's mode, the
trackers' installs, and the run's name and directory."""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path

from pydantic import BaseModel

from zerofit.config.batching import BatchSplit
from zerofit.config.rules.model import adaptation_method, check_levers
from zerofit.config.schema import ZerofitConfig
from zerofit.core.run_layout import run_dir_of


def _model_short_name(name_or_path: str) -> str:
    return Path(name_or_path.rstrip("/")).name or name_or_path


def default_run_name(cfg: ZerofitConfig, plan: BatchSplit) -> str:
    """A name that says model, method, preset, precision and global batch, so runs compare at a glance.

    Not the split (micro x accum x dp): it depends on the world size, and a run resumed on another world
    size must find its own run directory.
    """
    engine = cfg.distributed.preset or cfg.distributed.strategy
    return (
        f"{_model_short_name(cfg.model.name_or_path)}-{adaptation_method(cfg)}-{engine}-{cfg.train.precision}-"
        f"g{plan.global_batch_size}"
    )


def config_keys(model: type[BaseModel] = ZerofitConfig, prefix: str = "") -> list[str]:
    """Every dotted key and section of the schema (`optimizer`, `optimizer.lr`, ...)."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += config_keys(annotation, f"{prefix}{name}.")
    return out


def wandb_key_configured() -> bool:
    """True when W&B has an API key here (`WANDB_API_KEY` or a ~/.netrc entry for api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def check_length(problems: list[str], cfg: ZerofitConfig) -> None:
    """How long the run is: train.max_steps or train.epochs (not both, and epochs only where the step count
    can follow the data), and when it stops early."""
    t = cfg.train
    if t.max_steps is not None and t.epochs is not None:
        problems.append(
            f"train.max_steps = {t.max_steps} and train.epochs = {t.epochs} are both set, and each fixes the "
            "run's length; set one of them (train.epochs=N trains N passes over the data, the plan states the "
            "exact step count; to replace a config file's train.max_steps from the command line, add "
            "train.max_steps=null)"
        )
    if t.epochs is not None and cfg.distributed.ds_config is not None:
        problems.append(
            f"train.epochs = {t.epochs} with distributed.ds_config = {cfg.distributed.ds_config!r}: the step "
            "count of an epoch is known only once the data is loaded, after the DeepSpeed file is filled in; "
            "set train.max_steps instead (the plan of an epochs run prints its step count)"
        )
    _check_early_stopping(problems, cfg)
    _check_harness(problems, cfg)


def _check_harness(problems: list[str], cfg: ZerofitConfig) -> None:
    """`eval.harness` needs lm-eval installed, and its `best_metric` names one of its tasks."""
    import importlib.util

    h = cfg.eval.harness
    if h.tasks and importlib.util.find_spec("lm_eval") is None:
        problems.append(
            f"eval.harness.tasks = {h.tasks} runs EleutherAI's lm-eval, which is not installed; install it with "
            "pip install 'zerofit[eval]', or set eval.harness.tasks=[]"
        )
    task = (h.best_metric or "").rpartition("/")[0]
    if h.best_metric is not None and task not in h.tasks:
        problems.append(
            f"eval.harness.best_metric = {h.best_metric!r}: must be <task>/<metric> of a task in eval.harness.tasks "
            f"({', '.join(h.tasks) or 'none'}), e.g. zerofit_demo_format/acc; or leave it unset to judge by eval/loss"
        )


def _check_early_stopping(problems: list[str], cfg: ZerofitConfig) -> None:
    """Early stopping needs evaluations between steps to count its patience in: of eval/loss, or of the
    harness metric that `eval.harness.best_metric` names."""
    es, d, h = cfg.train.early_stopping, cfg.data, cfg.eval.harness
    if es.patience <= 0:
        return
    if h.best_metric is not None:
        if h.every_steps <= 0:
            problems.append(
                f"train.early_stopping.patience = {es.patience} counts harness evaluations of "
                f"{h.best_metric}, but eval.harness.every_steps = 0 evaluates only at the end; set "
                "eval.harness.every_steps (e.g. 50), or train.early_stopping.patience=0"
            )
        return
    if d.eval_path is None and d.eval_split is None:
        problems.append(
            f"train.early_stopping.patience = {es.patience} stops the run when eval/loss stops improving, but "
            "there is no evaluation data; set data.eval_path or data.eval_split (e.g. data.eval_split=0.02) "
            "with eval.every_steps, or train.early_stopping.patience=0"
        )
    elif cfg.eval.every_steps <= 0:
        problems.append(
            f"train.early_stopping.patience = {es.patience} counts evaluations during the run, but "
            "eval.every_steps = 0 evaluates only at the end; set eval.every_steps (e.g. 50), or "
            "train.early_stopping.patience=0"
        )


def check_training(problems: list[str], cfg: ZerofitConfig) -> None:
    """Rules between keys that a field's own bounds (schema.py) cannot say: LoRA's rank when LoRA is on,
    learning-rate scaling's reference batch, the keys a resume may change."""
    if cfg.lora.enabled and cfg.lora.r <= 0:
        problems.append(f"lora.r = {cfg.lora.r!r}: must be > 0")
    o = cfg.optimizer
    if o.lr_scaling != "none" and o.base_batch_size is None:
        problems.append(
            f"optimizer.lr_scaling = {o.lr_scaling!r} needs optimizer.base_batch_size (the global batch "
            "optimizer.lr was tuned for); set it, or optimizer.lr_scaling=none"
        )
    check_levers(problems, cfg)
    check_trackers(problems, cfg)
    known = config_keys()
    for key in cfg.checkpoint.allow_changes:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"checkpoint.allow_changes: {key!r} is not a config key or section; {hint}(name keys as "
                "dotted paths, e.g. [optimizer.lr,train.max_steps], or whole sections, e.g. [optimizer])"
            )


def check_trackers(problems: list[str], cfg: ZerofitConfig) -> None:
    """A tracker the config turns on is installed (looked up, not imported: a plan stays light), so a run
    that asked for TensorBoard or MLflow never trains without it."""
    asked = {"tensorboard": cfg.logging.tensorboard, "mlflow": cfg.logging.mlflow.enabled}
    for extra, on in asked.items():
        if on and importlib.util.find_spec(extra) is None:
            key = "logging.tensorboard = true" if extra == "tensorboard" else "logging.mlflow.enabled = true"
            problems.append(
                f"{key} logs this run to {TRACKER_NAMES[extra]}, which is not installed here; install it with "
                f"`pip install 'zerofit[{extra}]'`, or turn it off ({key.split(' = ')[0]}=false): "
                "metrics.jsonl is written either way"
            )


# The trackers' names as users know them, by their install extra (and Python package).
TRACKER_NAMES = {"tensorboard": "TensorBoard", "mlflow": "MLflow"}


def fill_logging(cfg: ZerofitConfig) -> None:
    """Decide the W&B mode: the environment's off switch, else the config's, else by whether a key exists."""
    if os.environ.get("WANDB_MODE") == "disabled":
        # W&B's own off switch (CI, tests, a shell without W&B) wins over the config, as in any W&B program;
        # config.yaml then records the mode that ran.
        cfg.logging.wandb.mode = "disabled"
    elif cfg.logging.wandb.mode is None:
        cfg.logging.wandb.mode = "online" if wandb_key_configured() else "offline"


def fill_run_dir(cfg: ZerofitConfig, plan: BatchSplit) -> Path:
    """Decide the run name (the default one says model, method, preset, precision, global batch) and the
    run directory it names under `output_dir`."""
    name = default_run_name(cfg, plan) if cfg.run_name is None else cfg.run_name
    run_dir = run_dir_of(cfg.output_dir, name)  # one folder name: nothing is written outside output_dir
    cfg.run_name = name
    return run_dir
