"""What `lora.target_modules` means for each model family: meaning words -> the module and parameter names.

`lora.target_modules` is a meaning (`attention`, `mlp`, `all-linear`) or a list of module names (peft's rule: a
name matches the end of a module's full name). A meaning is mapped here, per `model_type` of the model's
config.json, to name suffixes that peft matches, fused projections included (Phi-3 / Phi-4 `qkv_proj`,
`gate_up_proj`). Mixture-of-experts blocks in transformers 5 keep their routed experts as fused 3-D parameters
(`experts.gate_up_proj`: experts x 2*ffn x hidden), not `nn.Linear`s, so no module name reaches them: they are
adapted through peft's parameter targeting (`LoraConfig.target_parameters`), and only when asked. The two MoE
keys:

- `lora.moe_experts`: `none` (expert weights frozen), `shared` (the default: the `mlp` and `all-linear`
  meanings also adapt the shared experts' linears, for families that have them, e.g. Qwen2-MoE; routed
  experts frozen), `all` (as shared, and every routed expert through `target_parameters`, whatever
  `target_modules` is: a LoRA pair per expert weight, many more trainable parameters);
- `lora.train_router`: `false` (the default: the router keeps its routing) or `true` (the router's weights train
  in full, through peft's `modules_to_save`; they are experts x hidden, small).

Pure (no torch): the planner and the config checks use it from a config dict alone; `zerofit.models.lora` applies it.
Unknown families: `all-linear` falls back to peft's own rule (every linear layer but the output head);
`attention` / `mlp` are refused with the fix (explicit names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from zerofit.core.errors import ConfigError

__all__ = [
    "MOE_EXPERTS",
    "TARGET_MEANINGS",
    "FamilyModules",
    "LoraTargets",
    "family_modules",
    "known_model_types",
    "model_type_of",
    "resolve_lora_targets",
    "vision_lora_summary",
]

TARGET_MEANINGS = ("attention", "mlp", "all-linear")
MOE_EXPERTS = ("none", "shared", "all")

_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class FamilyModules:
    """The name suffixes of one family's adaptable parts (peft matches a suffix against the end of a name).

    `mlp` is the dense MLP (every layer of a dense model, the dense layers of an MoE model), `shared_expert` the
    shared experts' linears, `expert_parameters` the routed experts' fused 3-D parameters, `router` the router
    modules (trained in full when `lora.train_router`). Empty tuples: the family has no such part.
    """

    family: str
    attention: tuple[str, ...] = _ATTENTION
    mlp: tuple[str, ...] = _MLP
    shared_expert: tuple[str, ...] = ()
    expert_parameters: tuple[str, ...] = ()
    router: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        """Whether the family routes tokens to experts (it has routed expert parameters)."""
        return bool(self.expert_parameters)


_DENSE = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma-2",
    "gemma3": "Gemma-3",
    "gemma3_text": "Gemma-3",
}

_FAMILIES: dict[str, FamilyModules] = {
    **{model_type: FamilyModules(family=name) for model_type, name in _DENSE.items()},
    # Phi-3 and Phi-4 (model_type phi3): q, k, v fused in one projection, gate and up in another.
    "phi3": FamilyModules(
        family="Phi-3",
        attention=("self_attn.qkv_proj", "self_attn.o_proj"),
        mlp=("mlp.gate_up_proj", "mlp.down_proj"),
    ),
    "mixtral": FamilyModules(family="Mixtral", expert_parameters=_EXPERT_PARAMETERS, router=("mlp.gate",)),
    "qwen3_moe": FamilyModules(
        family="Qwen3-MoE", expert_parameters=_EXPERT_PARAMETERS, router=("mlp.gate",)
    ),
    "qwen2_moe": FamilyModules(
        family="Qwen2-MoE",
        shared_expert=("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"),
        expert_parameters=_EXPERT_PARAMETERS,
        router=("mlp.gate", "mlp.shared_expert_gate"),
    ),
}


@dataclass(frozen=True)
class LoraTargets:
    """What peft is told to adapt: `target_modules` (name suffixes, or peft's own `"all-linear"` rule for a
    family this table does not know), `target_parameters` (routed experts' 3-D parameters), `modules_to_save`
    (trained in full: the router); `summary` says it in words for the plan."""

    target_modules: tuple[str, ...] | str
    target_parameters: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()
    family: str | None = None
    summary: str = ""


def model_type_of(model_config: Mapping[str, Any]) -> str:
    """The `model_type` of a config.json dict (empty when it has none)."""
    return str(model_config.get("model_type") or "")


def family_modules(model_type: str) -> FamilyModules | None:
    """The adaptable parts of the family with this `model_type`, None for a family zerofit does not map."""
    return _FAMILIES.get(model_type)


def known_model_types() -> tuple[str, ...]:
    """Every `model_type` the meaning words are mapped for."""
    return tuple(_FAMILIES)


def resolve_lora_targets(
    model_config: Mapping[str, Any],
    target_modules: str | Sequence[str],
    moe_experts: str = "shared",
    train_router: bool = False,
) -> LoraTargets:
    """Map `lora.target_modules` (a meaning or names) and the MoE keys to what peft adapts for this model.

    Refuses (ConfigError, one paragraph) a meaning word for an unmapped family, an unknown `moe_experts`, the
    MoE keys asking for experts or a router a dense model does not have, and a choice that adapts nothing.
    """
    model_type = model_type_of(model_config)
    fam = family_modules(model_type)
    _check_moe_keys(model_type, fam, moe_experts, train_router)
    is_moe = fam is not None and fam.is_moe
    if not isinstance(target_modules, str) and not target_modules and not (is_moe and moe_experts == "all"):
        _refuse_empty_list(is_moe)
    if fam is None:
        return _unmapped_family(model_type, target_modules)
    modules = _named_modules(fam, target_modules, _has_dense_mlp(fam, model_config))
    # Shared experts are linears: the MLP meanings take them (explicit names match them by peft's rule).
    # Routed experts cannot be named as modules: `all` adds them to any target value.
    if fam.is_moe and target_modules in ("mlp", "all-linear") and moe_experts in ("shared", "all"):
        modules = _dedupe(modules + fam.shared_expert)
    experts = fam.expert_parameters if fam.is_moe and moe_experts == "all" else ()
    router = fam.router if train_router else ()
    if not modules and not experts:
        _refuse(
            f"lora.target_modules = {_shown(target_modules)} with lora.moe_experts = {moe_experts!r} adapts "
            f"nothing of this {fam.family} model: its MLPs are mixture-of-experts blocks, which that setting "
            "leaves frozen. Fix: lora.target_modules=all-linear (attention too), or lora.moe_experts=all (every "
            "routed expert through peft's parameter targeting)"
        )
    return LoraTargets(
        target_modules=modules,
        target_parameters=experts,
        modules_to_save=router,
        family=fam.family,
        summary=_summary(fam, target_modules, moe_experts, train_router),
    )


def vision_lora_summary(text: LoraTargets, vision_tower: bool, projector_full: bool) -> str:
    """What LoRA adapts of a vision-language model, in words: the language model's targets (`text`, mapped
    by its family), the vision tower's linears, the projector trained in full."""
    names = (text.target_modules,) if isinstance(text.target_modules, str) else text.target_modules
    parts = ["the language model's " + (text.summary or ", ".join(names))]
    parts += ["the vision tower's linears"] if vision_tower else []
    parts += ["the projector in full"] if projector_full else []
    return "LoRA on " + "; ".join(parts)


def _refuse_empty_list(is_moe: bool) -> NoReturn:
    """`lora.target_modules=[]` without routed experts to adapt instead (`lora.moe_experts=all` on a
    mixture-of-experts model): it names no module, so nothing would train."""
    experts = " or lora.moe_experts=all to adapt only the routed experts" if is_moe else ""
    _refuse(
        "lora.target_modules = []: an empty list names no module, so LoRA would adapt nothing. The rule: one "
        f"of {', '.join(TARGET_MEANINGS)} or a list of module names (each matches the end of a module's full "
        "name). Fix: e.g. lora.target_modules=all-linear or lora.target_modules=[q_proj,v_proj]"
        f"{experts} (or lora.enabled=false for a full fine-tune)"
    )


def _has_dense_mlp(fam: FamilyModules, model_config: Mapping[str, Any]) -> bool:
    """Whether some decoder layer has a dense MLP: every layer of a dense model; an MoE model's layers listed in
    `mlp_only_layers` or skipped by `decoder_sparse_step` > 1 (Qwen-MoE); Mixtral has none."""
    if not fam.is_moe:
        return True
    return bool(model_config.get("mlp_only_layers")) or int(model_config.get("decoder_sparse_step") or 1) > 1


def _named_modules(
    fam: FamilyModules, target_modules: str | Sequence[str], dense_mlp: bool
) -> tuple[str, ...]:
    """The module-name suffixes of a meaning word, or the explicit names as given (peft's suffix rule)."""
    if isinstance(target_modules, str):
        if target_modules not in TARGET_MEANINGS:
            _refuse(
                f"lora.target_modules = {target_modules!r} is not a meaning zerofit knows: the rule is one of "
                f"{', '.join(TARGET_MEANINGS)} or a list of module names. Fix: e.g. lora.target_modules=all-linear "
                "or lora.target_modules=[q_proj,v_proj]"
            )
        attention = fam.attention if target_modules in ("attention", "all-linear") else ()
        mlp = fam.mlp if target_modules in ("mlp", "all-linear") and dense_mlp else ()
        return attention + mlp
    return tuple(target_modules)


def _unmapped_family(model_type: str, target_modules: str | Sequence[str]) -> LoraTargets:
    """A family the table does not map: names and `all-linear` (peft's rule) work, the other meanings do not."""
    if not isinstance(target_modules, str):
        return LoraTargets(target_modules=tuple(target_modules), summary="the listed modules")
    if target_modules == "all-linear":
        return LoraTargets(
            target_modules="all-linear", summary="every linear layer but the output head (peft's rule)"
        )
    _refuse(
        f"lora.target_modules = {target_modules!r} for model_type {model_type or '(none)'!r}: zerofit maps the "
        f"meanings attention and mlp for {', '.join(known_model_types())} only. Fix: list the module names "
        "(e.g. lora.target_modules=[q_proj,v_proj]) or use lora.target_modules=all-linear"
    )


def _check_moe_keys(model_type: str, fam: FamilyModules | None, moe_experts: str, train_router: bool) -> None:
    """`lora.moe_experts` must be a known choice; `all` and `train_router` need a mixture-of-experts model."""
    if moe_experts not in MOE_EXPERTS:
        _refuse(
            f"lora.moe_experts = {moe_experts!r}: the rule is one of {', '.join(MOE_EXPERTS)}. Fix: e.g. "
            "lora.moe_experts=shared"
        )
    is_moe = fam is not None and fam.is_moe
    if is_moe:
        return
    what = (
        f"{fam.family} (dense)" if fam else f"model_type {model_type or '(none)'!r} (not a mapped MoE family)"
    )
    if moe_experts == "all":
        _refuse(
            f"lora.moe_experts = 'all' for {what}: the setting adapts routed experts, which this model does not "
            "have. Fix: lora.moe_experts=shared (the default; nothing to adapt on a dense model) or use a "
            "mixture-of-experts model"
        )
    if train_router:
        _refuse(
            f"lora.train_router = true for {what}: this model has no router to train. Fix: "
            "lora.train_router=false"
        )


def _summary(
    fam: FamilyModules, target_modules: str | Sequence[str], moe_experts: str, train_router: bool
) -> str:
    """The targets in words: which parts of the family are adapted, and what an MoE block does."""
    what = target_modules if isinstance(target_modules, str) else "the listed modules"
    text = f"{fam.family}: {what}"
    if not fam.is_moe:
        return text
    routed = (
        "every routed expert (peft target_parameters)" if moe_experts == "all" else "routed experts frozen"
    )
    if not fam.shared_expert:
        shared = ""
    elif not isinstance(target_modules, str):
        shared = "; shared experts where the names match"
    elif target_modules in ("mlp", "all-linear") and moe_experts in ("shared", "all"):
        shared = "; shared experts adapted"
    else:
        shared = "; shared experts frozen"
    experts = routed + shared
    router = "router trained in full" if train_router else "router frozen"
    return f"{text}; {experts}; {router}"


def _dedupe(names: tuple[str, ...]) -> tuple[str, ...]:
    """Names in first-seen order, once each."""
    return tuple(dict.fromkeys(names))


def _shown(target_modules: str | Sequence[str]) -> str:
    """The value as the user wrote it, for a message."""
    return repr(target_modules) if isinstance(target_modules, str) else repr(list(target_modules))


def _refuse(message: str) -> NoReturn:
    """Raise the one-paragraph ConfigError."""
    raise ConfigError([message])
