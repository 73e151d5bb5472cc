"""LoRA adapters through peft: one config and one way to apply it, for training and for planning.

The model pipeline (`zerofit.model`) and the planner's meta-device builds (`zerofit.planner.shapes`,
`zerofit.planner.trace`) both adapt models here, so the parameters the planner counts are exactly the
ones a run trains.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from zerofit.errors import ConfigError

__all__ = ["adaptable_module_names", "apply_lora", "check_target_modules", "lora_config"]


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


def adaptable_module_names(model: torch.nn.Module) -> list[str]:
    """Full names of the modules LoRA can adapt (linear, embedding and convolution layers), in model order."""
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return [
        name
        for name, module in model.named_modules()
        if name and (isinstance(module, kinds) or type(module).__name__ == "Conv1D")  # GPT-2's Conv1D
    ]


def check_target_modules(model: torch.nn.Module, target_modules: str | list[str]) -> None:
    """Refuse `lora.target_modules` entries that name no adaptable module of `model`.

    peft matches a listed name against the end of each module's full name (`q_proj` matches
    `model.layers.0.self_attn.q_proj`) and only fails when *no* entry matches: a misspelled entry next to a
    good one would silently leave those layers untrained. Works on a meta-device build, so a run checks
    before any weight is loaded.
    """
    if isinstance(target_modules, str):  # `all-linear`: peft's own rule, nothing to misspell
        return
    names = adaptable_module_names(model)
    unmatched = [
        target for target in target_modules if not any(n == target or n.endswith("." + target) for n in names)
    ]
    if not unmatched:
        return
    leaves = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))
    raise ConfigError(
        [
            f"lora.target_modules = {list(target_modules)!r}: {', '.join(repr(t) for t in unmatched)} "
            f"{'names' if len(unmatched) == 1 else 'name'} no module of {type(model).__name__} that LoRA can "
            f"adapt; the module names that exist are: {', '.join(leaves)}. Fix: use some of those names, or "
            "lora.target_modules=all-linear (every linear layer but the output head)"
        ]
    )


def apply_lora(model: torch.nn.Module, config: Any, seed: int | None = None) -> torch.nn.Module:
    """Wrap `model` with peft adapters; with `seed`, adapter init is reproducible on every rank and split.

    Adapter init (kaiming A) draws from the global RNG: seeding it from the run's seed makes every rank and
    every split start from the same adapters, without disturbing the caller's RNG stream.
    """
    from peft import get_peft_model

    targets = config.target_modules
    check_target_modules(model, targets if isinstance(targets, str) else sorted(targets))
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft still asks the deprecated `is_gradient_checkpointing`; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if seed is not None:
            torch.manual_seed(seed)
        return get_peft_model(model, config)
