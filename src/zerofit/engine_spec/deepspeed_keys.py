"""The DeepSpeed keys zerofit derives itself: precision blocks, the AdamW block, model-sized buckets.

Shared by the renderer (presets) and the user-file filler (`"auto"` values), which must write the same
numbers for the same run. No torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerofit.catalogue.models import model_config_dict
from zerofit.core.errors import ConfigError

if TYPE_CHECKING:
    from zerofit.resolution import ResolvedConfig

__all__ = [
    "DEEPSPEED_SCHEDULERS",
    "FP16_DYNAMIC_LOSS_SCALING",
    "bucket_keys",
    "hidden_size_buckets",
    "model_hidden_size",
    "offloads",
    "optimizer_block",
    "precision_blocks",
]

# DeepSpeed's dynamic loss scaling: start at 2**16, halve on overflow (after `hysteresis` overflows),
# double after `loss_scale_window` clean steps, never below 1. `loss_scale: 0` selects dynamic scaling.
FP16_DYNAMIC_LOSS_SCALING: dict[str, Any] = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


# The `scheduler.type` values DeepSpeed builds (deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES).
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def precision_blocks(precision: str) -> dict[str, dict[str, Any]]:
    """The `bf16` and `fp16` blocks for `train.precision`; both are written so neither default applies."""
    fp16: dict[str, Any] = {"enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.update(FP16_DYNAMIC_LOSS_SCALING)
    return {"bf16": {"enabled": precision == "bf16"}, "fp16": fp16}


def optimizer_block(resolved: ResolvedConfig) -> dict[str, Any]:
    """DeepSpeed's AdamW with zerofit's hyper-parameters (where DeepSpeed must own the optimizer)."""
    opt = resolved.config.optimizer
    return {
        "type": "AdamW",
        "params": {
            "lr": resolved.effective_lr,
            "betas": list(opt.betas),
            "eps": opt.eps,
            "weight_decay": opt.weight_decay,
        },
    }


def offloads(zero: dict[str, Any], key: str) -> bool:
    """True when `zero_optimization.<key>` (`offload_optimizer` / `offload_param`) moves state off the GPU."""
    block = zero.get(key) or {}
    return isinstance(block, dict) and block.get("device", "none") not in ("none", None)


def bucket_keys(stage: int) -> tuple[str, ...]:
    """The `zero_optimization` keys zerofit sizes from the model width at this ZeRO stage."""
    if stage == 3:
        return ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    return ("reduce_bucket_size",)


def hidden_size_buckets(hidden_size: int, stage: int) -> dict[str, int]:
    """Communication bucket sizes from the model width (the HF Trainer's `auto` rules)."""
    h = hidden_size
    buckets = {"reduce_bucket_size": h * h}
    if stage == 3:
        buckets["stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        buckets["stage3_param_persistence_threshold"] = 10 * h
    return buckets


def model_hidden_size(name_or_path: str) -> int:
    """The model's `hidden_size`, from the built-in catalogue or a local config.json (no weights read)."""
    config = model_config_dict(name_or_path)
    # A vision-language model's buckets carry its language model's gradients (the larger part).
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        raise ConfigError(
            [
                f"model.name_or_path = {name_or_path!r}: its config has no positive integer hidden_size "
                f"(got {hidden!r}), so zerofit cannot size DeepSpeed's communication buckets; set "
                "zero_optimization.reduce_bucket_size (and the stage3_* sizes) in your own file via "
                "distributed.ds_config"
            ]
        )
    return hidden
