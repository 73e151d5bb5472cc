"""LoRA adapters through peft: one config and one way to apply it, for training and for planning.

The model pipeline (`zerofit.model`) and the planner's meta-device builds (`zerofit.planner.shapes`,
`zerofit.planner.trace`) both adapt models here, so the parameters the planner counts are exactly the
ones a run trains.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["apply_lora", "lora_config"]


def lora_config(r: int, alpha: int, dropout: float, target_modules: str | list[str], use_dora: bool) -> Any:
    """The peft `LoraConfig` zerofit uses everywhere: causal LM, no bias training, `all-linear` = every
    linear layer but the output head."""
    from peft import LoraConfig

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        use_dora=use_dora,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, config: Any, seed: int | None = None) -> torch.nn.Module:
    """Wrap `model` with peft adapters; with `seed`, adapter init is reproducible on every rank and split.

    Adapter init (kaiming A) draws from the global RNG: seeding it from the run's seed makes every rank and
    every split start from the same adapters, without disturbing the caller's RNG stream.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft still asks the deprecated `is_gradient_checkpointing`; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if seed is not None:
            torch.manual_seed(seed)
        return get_peft_model(model, config)
