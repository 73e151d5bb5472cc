"""`resolve()`: check a whole config against the launch, collect every problem, derive every value.

After `resolve()` nothing is left for later layers to guess: the batch triple is exact for the launcher's
world size, the preset and W&B mode are concrete, the run name and run directory are fixed.
`batch.micro_batch_size=auto` is decided here too, by the micro-batch chooser the caller passes in (the
memory planner's, `zerofit.planner.choose_micro_batch`): the config layer sits below the planner and
never imports it.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from zerofit.batching import BatchConfigError, BatchPlan, solve_batch
from zerofit.catalogue import TINY_LLAMA
from zerofit.config.schema import ZerofitConfig
from zerofit.errors import ConfigError
from zerofit.presets import DEFAULT_PRESET, list_presets

# `batch.micro_batch_size=auto`: (config, world size) -> the micro-batch to use; raises ConfigError.
MicroBatchChooser = Callable[[ZerofitConfig, int], int]


@dataclass(frozen=True)
class ResolvedConfig:
    """A config with every derived value filled, plus the batch plan and run directory it implies."""

    config: ZerofitConfig
    plan: BatchPlan
    world_size: int
    run_dir: Path

    @property
    def effective_lr(self) -> float:
        """`optimizer.lr` after the opt-in scaling with the global batch (`optimizer.lr_scaling`)."""
        opt = self.config.optimizer
        if opt.lr_scaling == "none" or opt.base_batch_size is None:
            return opt.lr
        ratio = self.plan.global_batch_size / opt.base_batch_size
        return opt.lr * (ratio if opt.lr_scaling == "linear" else math.sqrt(ratio))

    @property
    def method(self) -> str:
        """How the model is adapted (`full`, `lora`, `qlora`, `lora-8bit`)."""
        return adaptation_method(self.config)

    @classmethod
    def for_planning(cls, config: ZerofitConfig, plan: BatchPlan) -> ResolvedConfig:
        """An unvalidated what-if: `config` at `plan`, for the planner to render and estimate.

        Never launched: `resolve()` is what validates a config; this only pairs it with a split so the
        engine spec of a candidate (another micro-batch, a remedy) can be rendered the way a run would be.
        """
        name = config.run_name or "planning"
        return cls(config=config, plan=plan, world_size=plan.dp_size, run_dir=Path(config.output_dir) / name)


def adaptation_method(cfg: ZerofitConfig) -> str:
    """`full`, `lora`, `qlora` or `lora-8bit`: how the model is adapted, for names and tables."""
    if not cfg.lora.enabled:
        return "full"
    return {"none": "lora", "4bit": "qlora", "8bit": "lora-8bit"}[cfg.quantization.load_in]


def _model_short_name(name_or_path: str) -> str:
    return Path(name_or_path.rstrip("/")).name or name_or_path


def default_run_name(cfg: ZerofitConfig, plan: BatchPlan) -> str:
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


def _check_positive(problems: list[str], **values: float | int | None) -> None:
    for key, value in values.items():
        if value is not None and value <= 0:
            problems.append(f"{key.replace('__', '.')} = {value!r}: must be > 0")


def resolve(
    config: ZerofitConfig, world_size: int, choose_micro_batch: MicroBatchChooser | None = None
) -> ResolvedConfig:
    """Validate `config` for a launch of `world_size` ranks and fill every derived value.

    `choose_micro_batch` decides `batch.micro_batch_size=auto` (without one, `auto` is refused). Raises
    one `ConfigError` listing every problem found.
    """
    cfg = config.model_copy(deep=True)
    problems: list[str] = []
    strategy = cfg.distributed.strategy

    if world_size < 1:
        problems.append(f"world size {world_size} must be >= 1")
    if strategy == "single" and world_size > 1:
        problems.append(
            f"distributed.strategy = 'single' runs one process, but the launcher started {world_size}; "
            "use distributed.strategy=deepspeed, fsdp or ddp for several ranks, or launch one process"
        )

    # Preset: default per strategy, must exist, must belong to the strategy.
    if cfg.distributed.preset is None:
        cfg.distributed.preset = DEFAULT_PRESET[strategy]
    preset_name = cfg.distributed.preset
    presets = list_presets()
    if preset_name is not None:
        if preset_name not in presets:
            listing = ", ".join(f"{n} ({p.strategy})" for n, p in presets.items())
            problems.append(
                f"distributed.preset = {preset_name!r} is not a known preset; available: {listing}"
            )
        elif presets[preset_name].strategy != strategy:
            same = [n for n, p in presets.items() if p.strategy == strategy]
            problems.append(
                f"distributed.preset = {preset_name!r} is a {presets[preset_name].strategy} preset but "
                f"distributed.strategy = {strategy!r}; set distributed.strategy={presets[preset_name].strategy}"
                + (f" or pick one of: {', '.join(same)}" if same else " or drop distributed.preset")
            )
    if cfg.distributed.ds_config is not None:
        if strategy != "deepspeed":
            problems.append(
                f"distributed.ds_config = {cfg.distributed.ds_config!r} is a DeepSpeed config but "
                f"distributed.strategy = {strategy!r}; set distributed.strategy=deepspeed or drop ds_config"
            )
        elif not Path(cfg.distributed.ds_config).is_file():
            problems.append(f"distributed.ds_config = {cfg.distributed.ds_config!r}: file does not exist")

    # Batch: exact split for this world size; `auto` is the planner's to decide.
    b = cfg.batch
    plan: BatchPlan | None = None
    if b.micro_batch_size == "auto":
        if choose_micro_batch is None:
            problems.append(
                "batch.micro_batch_size = 'auto' needs the memory planner to choose it, and this entry point "
                "has none; pass an integer batch.micro_batch_size"
            )
        elif not problems:  # the planner renders the engine: only for an engine choice that is valid
            try:
                micro = choose_micro_batch(cfg, world_size)
                plan = solve_batch(world_size, b.global_batch_size, micro, None)
            except ConfigError as exc:
                problems.extend(exc.problems)
            except BatchConfigError as exc:
                problems.append(f"batch: {exc}")
    else:
        try:
            plan = solve_batch(world_size, b.global_batch_size, b.micro_batch_size, b.grad_accum_steps)
        except BatchConfigError as exc:
            problems.append(f"batch: {exc}")

    t, o, s, d = cfg.train, cfg.optimizer, cfg.scheduler, cfg.data
    _check_positive(
        problems,
        train__max_steps=t.max_steps,
        optimizer__lr=o.lr,
        data__max_seq_len=d.max_seq_len,
        logging__log_every=cfg.logging.log_every,
        lora__r=cfg.lora.r if cfg.lora.enabled else None,
        optimizer__base_batch_size=o.base_batch_size,
    )
    if t.max_grad_norm is not None and t.max_grad_norm < 0:
        problems.append(
            f"train.max_grad_norm = {t.max_grad_norm}: must be >= 0 (0 or null disables clipping)"
        )
    if s.warmup_steps < 0:
        problems.append(f"scheduler.warmup_steps = {s.warmup_steps}: must be >= 0")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        problems.append(f"scheduler.min_lr_ratio = {s.min_lr_ratio}: must be in [0, 1]")
    if o.lr_scaling != "none" and o.base_batch_size is None:
        problems.append(
            f"optimizer.lr_scaling = {o.lr_scaling!r} needs optimizer.base_batch_size (the global batch "
            "optimizer.lr was tuned for); set it, or optimizer.lr_scaling=none"
        )
    if not 0.0 <= cfg.lora.dropout < 1.0:
        problems.append(f"lora.dropout = {cfg.lora.dropout}: must be in [0, 1)")
    if cfg.checkpoint.every_steps < 0:
        problems.append(
            f"checkpoint.every_steps = {cfg.checkpoint.every_steps}: must be >= 0 (0 = at the end)"
        )
    if cfg.checkpoint.keep_last < 1:
        problems.append(f"checkpoint.keep_last = {cfg.checkpoint.keep_last}: must be >= 1")
    known = config_keys()
    for key in cfg.checkpoint.allow_changes:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"checkpoint.allow_changes: {key!r} is not a config key or section; {hint}(name keys as "
                "dotted paths, e.g. [optimizer.lr,train.max_steps], or whole sections, e.g. [optimizer])"
            )
    if cfg.quantization.load_in != "none" and not cfg.lora.enabled:
        problems.append(
            f"quantization.load_in = {cfg.quantization.load_in!r} freezes quantized base weights, so it needs "
            "LoRA: set lora.enabled=true (QLoRA) or quantization.load_in=none for full fine-tuning"
        )
    # Checked on 2 gloo ranks: 4-bit works under FSDP2 and ZeRO-3 (+offload), 8-bit under ZeRO-3, but
    # FSDP2 re-gathers 8-bit weights as plain tensors without their int8 state and the forward fails.
    if cfg.quantization.load_in == "8bit" and strategy == "fsdp":
        problems.append(
            "quantization.load_in = '8bit' with distributed.strategy = 'fsdp': FSDP2 re-gathers bitsandbytes "
            "8-bit weights as plain tensors without their int8 quantization state, so the forward fails; use "
            "quantization.load_in=4bit (QLoRA shards under FSDP2), or distributed.strategy=deepspeed (8-bit "
            "works with every ZeRO stage), ddp or single"
        )
    if not Path(d.path).is_file():
        problems.append(
            f"data.path = {d.path!r}: file does not exist (relative paths are from {os.getcwd()})"
        )
    name = cfg.model.name_or_path
    if name != TINY_LLAMA and name.startswith((".", "/")) and not Path(name).is_dir():
        problems.append(f"model.name_or_path = {name!r}: local model folder does not exist")

    if problems or plan is None:
        raise ConfigError(problems)

    cfg.batch.global_batch_size = plan.global_batch_size
    cfg.batch.micro_batch_size = plan.micro_batch_size
    cfg.batch.grad_accum_steps = plan.grad_accum_steps
    if cfg.logging.wandb.mode is None:
        cfg.logging.wandb.mode = "online" if wandb_key_configured() else "offline"
    if cfg.run_name is None:
        cfg.run_name = default_run_name(cfg, plan)
    return ResolvedConfig(
        config=cfg, plan=plan, world_size=world_size, run_dir=Path(cfg.output_dir) / cfg.run_name
    )
