"""What `cfg`'s LoRA adapts, for `zerofit plan` (its `LoRA:` line and the --json `lora` block), without
importing peft, bitsandbytes or transformers' modeling stack when the answer is known.

The counts (modules and expert parameters peft adapts, modules trained in full, trainable parameters) are
peft's own, on a meta-device build of the whole model (no weights): exact for any architecture
transformers builds, vision-language models and mixture-of-experts included. That build costs seconds of
imports (transformers' modeling modules, peft, and through it torch's compiler stack), so its answer is kept
in the planner's cache (`zerofit.core.derived_cache`) under a key that cannot go stale: the model's config.json
dict, the whole `lora` section, the library versions and zerofit's source digest. A cached report is checked
before use: every field of its type, and the names and summary (what `zerofit.models.lora_targets` maps
from the config alone) as they are mapped now; one that fails is computed again. The report of a family
`zerofit.catalogue.layouts` reads (dense, Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen2-VL / Qwen2.5-VL) comes from its
config alone, before the cache (`zerofit.planner.config_shapes`: the same fields, held equal to peft's by
tests/unit/planner/test_config_layout.py), so its first plan builds nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

from zerofit.catalogue.models import model_config_dict
from zerofit.core.derived_cache import cache_key, conforms, read_cache, write_cache
from zerofit.core.errors import ConfigError
from zerofit.models.lora_targets import resolve_lora_targets
from zerofit.planner.config_shapes import adapted, lora_entry

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig

__all__ = ["lora_targets_report"]

_VERSION = 1  # the layout of a cached report


class _Report(TypedDict):
    """What LoRA adapts of a language model: the mapped names and peft's counts."""

    summary: str
    family: str | None
    target_modules: str | list[str]
    target_parameters: list[str]
    modules_to_save: list[str]
    adapted_modules: int
    adapted_parameters: int
    full_modules: int
    trainable_params: int
    described: str


class _VisionReport(TypedDict):
    """What LoRA adapts of a vision-language model, in words with its counts (`apply_vision_lora`)."""

    described: str


def lora_targets_report(cfg: ZerofitConfig) -> dict[str, Any] | None:
    """What `cfg`'s LoRA adapts: the family, the mapped module and expert-parameter names, the router choice,
    and the counts peft reaches on a meta-device build of the whole model. None without LoRA; {"error": ...}
    for a model not buildable from its config (never cached)."""
    if not cfg.lora.enabled:
        return None
    config = _model_config(cfg)
    from_config = _from_config(cfg, config) if config is not None else None
    if from_config is not None:  # from the config alone (`planner.config_shapes`)
        return from_config
    key = _key(cfg, config) if config is not None else None
    cached = read_cache(key) if key else None
    if cached is not None and config is not None and _sound(cached, cfg, config):
        return cached
    report = _computed(cfg)
    if key and "error" not in report:
        write_cache(key, report)
    return report


def _model_config(cfg: ZerofitConfig) -> dict[str, Any] | None:
    """The model's config.json dict (catalogue or local folder; None when there is none to read)."""
    try:
        return model_config_dict(cfg.model.name_or_path)
    except ConfigError:
        return None  # the build reports it


def _key(cfg: ZerofitConfig, config: dict[str, Any]) -> str:
    """The cache entry of `cfg`'s report (`config`: the model's config.json dict): everything the counts
    depend on."""
    return cache_key("lora_report", _VERSION, {"config": config, "lora": cfg.lora.model_dump(mode="json")})


def _sound(entry: dict[str, Any], cfg: ZerofitConfig, config: dict[str, Any]) -> bool:
    """A cached report's check before use: its fields and their types; for a language model also the names
    and summary `resolve_lora_targets` maps from `config` now (the counts are peft's, kept as data)."""
    if conforms(entry, _VisionReport):
        return True
    if not conforms(entry, _Report):
        return False
    lora = cfg.lora
    try:
        targets = resolve_lora_targets(config, lora.target_modules, lora.moe_experts, lora.train_router)
    except ConfigError:
        return False  # the build refuses it with the message
    return _mapped(targets) == {name: entry[name] for name in _mapped(targets)}


def _mapped(targets: Any) -> dict[str, Any]:
    """The report's fields `resolve_lora_targets` decides (`LoraTargets` in JSON form)."""
    names = targets.target_modules
    return {
        "summary": targets.summary,
        "family": targets.family,
        "target_modules": names if isinstance(names, str) else list(names),
        "target_parameters": list(targets.target_parameters),
        "modules_to_save": list(targets.modules_to_save),
    }


def _from_config(cfg: ZerofitConfig, config: dict[str, Any]) -> dict[str, Any] | None:
    """The report from the model's config alone, exactly what `_computed` measures (None: the rule cannot
    decide it; `zerofit.planner.config_shapes`)."""
    from zerofit.models.lora import AdaptedCounts
    from zerofit.models.vision import is_vision_config

    lora = cfg.lora
    moe = (lora.moe_experts, lora.train_router)
    vision = (lora.projector, lora.vision_tower) if is_vision_config(config) else None
    entry = lora_entry(config, lora.r, lora.target_modules, lora.use_dora, moe, vision)
    found = adapted(config, lora.target_modules, moe, vision)
    if entry is None or found is None:
        return None
    trainable = entry["layer_trainable_params"] * found.layout.num_layers + entry["outside_trainable_params"]
    counts = AdaptedCounts(found.modules, 0, 1 if found.saved else 0, trainable)
    if vision is not None:
        return {"described": f"{found.summary}: {counts.describe()}"}
    return _counted(resolve_lora_targets(config, lora.target_modules, *moe), counts)


def _counted(targets: Any, counts: Any) -> dict[str, Any]:
    """A language model's report: the mapped names (`LoraTargets`) and what peft reached (`AdaptedCounts`)."""
    return {
        **_mapped(targets),
        "adapted_modules": counts.modules,
        "adapted_parameters": counts.parameters,
        "full_modules": counts.full,
        "trainable_params": counts.trainable_params,
        "described": f"{targets.summary}: {counts.describe()}",
    }


def _computed(cfg: ZerofitConfig) -> dict[str, Any]:
    """The report from peft applied to a meta-device build of the model (seconds: the imports)."""
    from zerofit.models.build import lora_spec
    from zerofit.models.lora import adapted_counts, apply_lora, model_targets
    from zerofit.models.meta import build_meta_model
    from zerofit.models.vision import apply_vision_lora, is_vision_config

    spec = lora_spec(cfg)
    try:  # a built-in model from its catalogued config (planning never writes or converts its weights)
        meta = build_meta_model(cfg.model.name_or_path, attn_implementation="eager")  # names and counts only
    except (ConfigError, ValueError, KeyError, ImportError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if is_vision_config(meta.config.to_dict()):  # what `apply_vision_lora` adapts, in words with its counts
        lora = cfg.lora
        return {"described": apply_vision_lora(meta, spec, lora.projector, lora.vision_tower, cfg.seed)[1]}
    targets = model_targets(meta, spec)
    return _counted(targets, adapted_counts(apply_lora(meta, spec, seed=cfg.seed)))
