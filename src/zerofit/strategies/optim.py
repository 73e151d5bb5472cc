"""Optimizer and learning-rate schedule of a run.

The schedule is a `LambdaLR` stepped once per optimizer step (never per micro-step), so the LR curve does
not depend on the batch split. The learning rate passed in is `ResolvedConfig.effective_lr`: the opt-in
scaling with the global batch is computed once, in `config/resolve.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.core.lazy import import_bitsandbytes
from zerofit.core.messages import warn
from zerofit.strategies.optim_dtensor import sharded


def _is_matrix(p: torch.nn.Parameter) -> bool:
    """Whether `p` is >= 2-D: a ZeRO-3 parameter is an empty placeholder between uses, its shape `ds_shape`."""
    return len(getattr(p, "ds_shape", p.shape)) >= 2


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: weight decay on matrices (>= 2-D), none on biases and norms.

    Frozen parameters (LoRA's base weights, quantized weights) are left out entirely, so optimizer state
    is only allocated for what trains. Empty groups are dropped (DeepSpeed rejects them).
    """
    decay = [p for p in model.parameters() if p.requires_grad and _is_matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not _is_matrix(p)]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _bitsandbytes_optim(name: str) -> Any:
    """The bitsandbytes optimizer class for `name`, or an actionable error if bitsandbytes is missing."""
    try:
        bnb = import_bitsandbytes()
    except ImportError as exc:
        raise ConfigError(
            [
                f"optimizer.name = {name!r} needs the bitsandbytes package, which cannot be imported "
                f"({exc}); install it with `pip install bitsandbytes` or set optimizer.name=adamw"
            ]
        ) from None
    if name == "paged_adamw_8bit" and not torch.cuda.is_available():
        # Paging moves optimizer state between GPU and host memory; without a GPU there is nothing to page.
        warn("optimizer.name=paged_adamw_8bit: no CUDA device, using non-paged AdamW8bit instead")
        name = "adamw_8bit"
    return {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "lion_8bit": bnb.optim.Lion8bit,
    }[name]


def build_optimizer(model: torch.nn.Module, cfg: ZerofitConfig, lr: float) -> torch.optim.Optimizer:
    """The client optimizer named by `optimizer.name` over the trainable parameters of `model`."""
    o = cfg.optimizer
    groups = param_groups(model, o.weight_decay)
    if not groups:
        raise ConfigError(
            [
                "the model has no trainable parameters (every parameter has requires_grad=False); check "
                "lora.target_modules matches module names of the model, or set lora.enabled=false"
            ]
        )
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    cls = _bitsandbytes_optim(o.name)
    if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
        cls = sharded(cls)  # FSDP2: bitsandbytes kernels step each rank's local shard (optim_dtensor.py)
    if o.name == "lion_8bit":  # Lion has no epsilon
        return cls(groups, lr=lr, betas=o.betas, weight_decay=o.weight_decay)
    return cls(groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def lr_multiplier(
    name: str, warmup_steps: int, max_steps: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """The factor on the peak LR at optimizer step `step` (0-based): warmup, then constant/linear/cosine.

    Warmup ramps (step + 1) / (warmup + 1), so step 0 already trains (no wasted step at LR 0) and the
    peak is reached at step `warmup_steps`. Decay then runs from 1 to `min_lr_ratio` over the remaining
    steps, reaching the floor just after the last step.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        shape = 1.0 - progress if name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ZerofitConfig, max_steps: int) -> Any:
    """A `LambdaLR` over `optimizer` for `scheduler.name`; the strategy steps it once per optimizer step."""
    s = cfg.scheduler
    factor = lr_multiplier(s.name, s.warmup_steps, max_steps, s.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factor)


def resume_schedule(
    scheduler: Any, model: torch.nn.Module, cfg: ZerofitConfig, lr: float | None, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """After a checkpoint load: this config's hyperparameters in the loaded optimizer, and its schedule at
    the loaded step. Returns the schedule the run continues with (the caller puts it in place).

    Loading restores the saved param groups (lr, betas, eps, weight decay) and the saved schedule (its base
    lr and, through the step, its position on the old curve), so a change that `checkpoint.allow_changes`
    accepted would otherwise be silently undone. The optimizer *state* (moments, step counts) stays as
    loaded. `lr` is the peak lr (None: keep the loaded base lr, for an optimizer DeepSpeed built from a
    user's file); the new `LambdaLR` starts at the step the loaded one had reached (skipped fp16 steps do
    not count), so the next update uses exactly the new config's `lr_multiplier(step)`.
    """
    optimizer = scheduler.optimizer
    step = int(scheduler.last_epoch)
    o = cfg.optimizer
    decays = [bool(g["weight_decay"]) for g in param_groups(model, 1.0)]  # the groups' order and rule
    if len(decays) != len(optimizer.param_groups):
        raise RuntimeError(f"{len(optimizer.param_groups)} param groups loaded, the model has {len(decays)}")
    for group, base, decay in zip(optimizer.param_groups, scheduler.base_lrs, decays, strict=True):
        group["initial_lr"] = lr if lr is not None else base
        if lr is None:
            continue  # DeepSpeed's optimizer from the user's file: its hyperparameters are the file's
        group["weight_decay"] = o.weight_decay if decay else 0.0
        if "betas" in group:
            group["betas"] = tuple(o.betas)
        if "eps" in group:
            group["eps"] = o.eps
    s = cfg.scheduler
    factor = lr_multiplier(s.name, s.warmup_steps, max_steps, s.min_lr_ratio)
    # last_epoch = step - 1: construction takes one step to `step`, setting lr = initial_lr * factor(step).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factor, last_epoch=step - 1)
