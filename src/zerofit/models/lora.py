"""LoRA adapters through peft: one config and one way to apply it, for training and for planning.

The model pipeline (`zerofit.models.build`) and the planner's meta-device builds (`zerofit.planner.shapes`,
`zerofit.planner.trace`) both adapt models here, so the parameters the planner counts are exactly the
ones a run trains.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from zerofit.core.errors import ConfigError
from zerofit.core.lazy import hidden_unless_loaded
from zerofit.models.lora_targets import LoraTargets, resolve_lora_targets

__all__ = [
    "AdaptedCounts",
    "AdapterSpec",
    "adaptable_module_names",
    "adapted_counts",
    "apply_lora",
    "check_target_modules",
    "lora_config",
    "model_targets",
    "peft_lora_config",
    "peft_without_bitsandbytes",
]


@dataclass(frozen=True)
class AdapterSpec:
    """The `lora` section as the adapters need it; `target_modules` is still the user's value (a meaning or
    names): what it adapts depends on the model's family, so `apply_lora` maps it against the model's config
    (`zerofit.models.lora_targets`)."""

    r: int
    alpha: int
    dropout: float
    target_modules: str | tuple[str, ...]
    use_dora: bool
    moe_experts: str = "shared"
    train_router: bool = False


def lora_config(
    r: int,
    alpha: int,
    dropout: float,
    target_modules: str | list[str] | tuple[str, ...],
    use_dora: bool,
    moe_experts: str = "shared",
    train_router: bool = False,
) -> AdapterSpec:
    """The adapter settings zerofit uses everywhere (training, planning, export); `apply_lora` turns them into
    peft's `LoraConfig` for the model at hand."""
    targets = target_modules if isinstance(target_modules, str) else tuple(target_modules)
    return AdapterSpec(r, alpha, dropout, targets, use_dora, moe_experts, train_router)


@contextmanager
def peft_without_bitsandbytes() -> Iterator[Any]:
    """peft, for calls that import it or create adapter layers, with bitsandbytes hidden unless already loaded.

    Both import bitsandbytes (`peft.helpers`; the LoRA dispatchers for 8- and 4-bit layers), ~1 CPU-s in
    every process of a LoRA run. A process that has not loaded bitsandbytes holds no bitsandbytes layer (a
    quantized load and the 8-bit optimizers import it first), so there is nothing to dispatch to it
    (`zerofit.core.lazy`); peft's cached "is bitsandbytes available" answers are dropped afterwards, so a
    quantized model later in the same process finds it as before.
    """
    with hidden_unless_loaded("bitsandbytes") as hidden:
        try:
            yield importlib.import_module("peft")
        finally:
            if hidden:
                import_utils = importlib.import_module("peft.import_utils")
                import_utils.is_bnb_available.cache_clear()
                import_utils.is_bnb_4bit_available.cache_clear()


def model_targets(model: torch.nn.Module, spec: AdapterSpec) -> LoraTargets:
    """What `spec` adapts of `model`: its meaning words mapped by the model's `model_type`."""
    config = getattr(model, "config", None)
    config_dict: Mapping[str, Any] = config.to_dict() if config is not None else {}
    return resolve_lora_targets(config_dict, spec.target_modules, spec.moe_experts, spec.train_router)


def peft_lora_config(spec: AdapterSpec, targets: LoraTargets, task_type: str = "CAUSAL_LM") -> Any:
    """peft's `LoraConfig`: causal LM (or `SEQ_CLS`, a reward model: peft then trains its score head in full,
    `modules_to_save`), no bias training; names, routed-expert parameters, a trained router."""
    with peft_without_bitsandbytes() as peft:
        lora_class = peft.LoraConfig

    names = targets.target_modules
    return lora_class(
        task_type=task_type,
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=names if isinstance(names, str) else list(names),
        target_parameters=list(targets.target_parameters) or None,
        modules_to_save=list(targets.modules_to_save) or None,
        use_dora=spec.use_dora,
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


def check_model_targets(model: torch.nn.Module, spec: AdapterSpec) -> LoraTargets:
    """Map `spec`'s targets for `model` and refuse any that name nothing in it (works on a meta build).

    Explicit names are checked as `check_target_modules` does; a meaning word's names come from zerofit's
    table, so one that matches nothing means the model's layout differs from its family's (refused with the
    fix rather than training fewer layers than asked).
    """
    targets = model_targets(model, spec)
    if isinstance(spec.target_modules, str):
        _check_mapped(model, spec, targets)
    else:
        check_target_modules(model, list(spec.target_modules))
    return targets


def _check_mapped(model: torch.nn.Module, spec: AdapterSpec, targets: LoraTargets) -> None:
    """Every module / parameter suffix a meaning word was mapped to must exist in `model`."""
    if isinstance(targets.target_modules, str):
        return  # peft's own all-linear rule for an unmapped family
    modules = [name for name, _ in model.named_modules()]
    params = [name for name, _ in model.named_parameters()]
    missing = [t for t in targets.target_modules if not any(n.endswith("." + t) for n in modules)]
    missing += [t for t in targets.target_parameters if not any(n.endswith("." + t) for n in params)]
    missing += [t for t in targets.modules_to_save if not any(n.endswith("." + t) for n in modules)]
    if missing:
        raise ConfigError(
            [
                f"lora.target_modules = {spec.target_modules!r} for this {targets.family} model "
                f"({type(model).__name__}): zerofit maps it to {', '.join(missing)}, which the model does not "
                "have (its layout differs from its family's). Fix: list the module names to adapt, e.g. "
                "lora.target_modules=[q_proj,v_proj]"
            ]
        )


def apply_lora(model: torch.nn.Module, spec: AdapterSpec, seed: int | None = None) -> torch.nn.Module:
    """Wrap `model` with peft adapters; with `seed`, adapter init is reproducible on every rank and split.

    Adapter init (kaiming A) draws from the global RNG: seeding it from the run's seed makes every rank and
    every split start from the same adapters, without disturbing the caller's RNG stream.
    """
    # A sequence classifier (a reward model, `zerofit.models.heads`) is peft's SEQ_CLS task: its head trains in full.
    task = "SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM"
    config = peft_lora_config(spec, check_model_targets(model, spec), task)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), peft_without_bitsandbytes() as peft:
        # peft still asks the deprecated `is_gradient_checkpointing`; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if seed is not None:
            torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


@dataclass(frozen=True)
class AdaptedCounts:
    """What the adapters reached: LoRA-adapted modules, LoRA-adapted parameters (routed experts' 3-D weights),
    modules trained in full (the router), and the trainable parameter count."""

    modules: int
    parameters: int
    full: int
    trainable_params: int

    def describe(self) -> str:
        """`28 modules + 8 expert parameters adapted, 4 modules trained in full; 1,234 trainable params`."""
        parts = [f"{self.modules} modules"]
        if self.parameters:
            parts.append(f"{self.parameters} expert parameters")
        text = " + ".join(parts) + " adapted"
        if self.full:
            text += f", {self.full} modules trained in full"
        return f"{text}; {self.trainable_params:,} trainable params"


def adapted_counts(model: torch.nn.Module) -> AdaptedCounts:
    """Count what peft adapted in `model` (a `PeftModel`, or anything holding its layers)."""
    with peft_without_bitsandbytes():
        from peft.tuners.lora import LoraLayer
        from peft.tuners.lora.layer import ParamWrapper
        from peft.utils.other import ModulesToSaveWrapper

    modules = parameters = full = 0
    for module in model.modules():
        if isinstance(module, ParamWrapper):
            parameters += 1
        elif isinstance(module, LoraLayer):
            modules += 1
        elif isinstance(module, ModulesToSaveWrapper):
            full += 1
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return AdaptedCounts(modules, parameters, full, trainable)
