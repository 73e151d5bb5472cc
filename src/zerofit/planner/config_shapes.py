"""The planner's shapes and LoRA counts from a model's config alone (`zerofit.catalogue.layouts`), in the form
of the planner's cache entries, so a first plan of a model that rule reads (dense, Mixtral, Qwen2-MoE,
Qwen3-MoE, Qwen2-VL / Qwen2.5-VL) needs no meta-device build.

`zerofit.planner.shapes` and `zerofit.planner.lora_report` read these entries before their cache: they are
exactly what the meta-device build and peft measure (`tests/unit/planner/test_config_layout.py` holds every
shipped config and catalogue model to that), and cost microseconds. Where the rule cannot decide (another
family, a target that names something other than a decoder layer's linears, e.g. the head, the embeddings
or a mixture of experts' fused expert weights, routed experts or a router adapted through peft's parameter
targeting or `modules_to_save`), these answer None and the caller builds the model on the meta device as
before.

peft's rule, reproduced for a decoder layer's linears: a listed name adapts every module whose full name is
it or ends with `.` + it; each adapted linear gains `lora_A` (r x in) and `lora_B` (out x r), and with DoRA a
magnitude vector (out), in that order. A vision-language model's targets are `vision_lora_targets`' (the
language model's linears by their last name part, the vision tower's linears, the projector in full).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerofit.catalogue.layouts import Layout, Part, model_layout
from zerofit.core.errors import ConfigError
from zerofit.models.lora_targets import resolve_lora_targets, vision_lora_summary
from zerofit.models.vision import vision_family

__all__ = ["Adapted", "adapted", "adapted_parts", "lora_entry", "shape_entry"]


def shape_entry(config: Mapping[str, Any], name_or_path: str) -> dict[str, Any] | None:
    """`ModelShape`'s fields as a cache entry holds them (JSON form), from the config alone; None when the
    layout rule cannot decide this model."""
    layout = model_layout(config)
    if layout is None:
        return None
    layer_numels = [n for part in layout.layer for n in part.numels]
    outside_numels = [n for part in layout.outside for n in part.numels]
    linears = [_linear(part) for part in layout.layer if part.kind == "linear"]
    layer_params, embed = sum(layer_numels), layout.vocab_size * layout.hidden_size
    head = 0 if layout.tied else embed
    total = layout.num_layers * layer_params + sum(outside_numels)
    return {
        "name_or_path": name_or_path, "model_type": layout.model_type, "hidden_size": layout.hidden_size,
        "intermediate_size": layout.intermediate_size, "num_layers": layout.num_layers,
        "num_heads": layout.num_heads, "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
        "vocab_size": layout.vocab_size, "tie_word_embeddings": layout.tied, "total_params": total,
        "layer_params": layer_params,
        "layer_linear_weight_params": sum(lin["in_features"] * lin["out_features"] for lin in linears),
        "embed_params": embed, "lm_head_params": head,
        "other_params": total - layout.num_layers * layer_params - embed - head, "linears": linears,
        "layer_param_numels": layer_numels, "outside_param_numels": outside_numels, "norms": _norms(layout),
        "attn_logit_softcapping": layout.attn_logit_softcapping,
        "final_logit_softcapping": layout.final_logit_softcapping,
        "sliding_window": layout.sliding_window, "sliding_layers": layout.sliding_layers,
        "num_experts": layout.num_experts, "experts_per_token": layout.experts_per_token,
        "expert_intermediate_size": layout.expert_intermediate_size,
        "shared_expert_intermediate_size": layout.shared_expert_intermediate_size,
        "layer_expert_params": layout.layer_expert_params, **_vision_fields(config, layout),
    }  # fmt: skip


def _vision_fields(config: Mapping[str, Any], layout: Layout) -> dict[str, int]:
    """A vision-language model's vision tower and projector parameters, split as `shapes._vision_fields`
    splits the build's (the projector by its family's module name, `zerofit.models.vision.FAMILIES`)."""
    vision = [part for part in layout.outside if part.vision]
    family = vision_family(dict(config))
    projector = sum(sum(p.numels) for p in vision if family and re.match(family.projector, p.name))
    return {"vision_params": sum(sum(p.numels) for p in vision) - projector, "projector_params": projector}


def _linear(part: Part) -> dict[str, Any]:
    """A linear part as `LinearShape`'s fields."""
    return {"name": part.name, "in_features": part.in_features, "out_features": part.out_features,
            "bias": part.bias}  # fmt: skip


def _norms(layout: Layout) -> list[list[Any]]:
    """The layer's norms as `ModelShape.norms` counts them (`shapes._norms_of`): a q/k norm over each head
    reads the whole q (k) projection per token, one rstd per head; any other norm its width, one rstd."""
    q_dim, kv_dim, head_dim = (
        layout.num_heads * layout.head_dim,
        layout.num_kv_heads * layout.head_dim,
        layout.head_dim,
    )
    found: list[list[Any]] = []
    for part in layout.layer:
        if part.kind != "norm":
            continue
        leaf = part.name.rpartition(".")[2]
        if part.out_features == head_dim and leaf.startswith(("q_", "k_")):
            per_token = q_dim if leaf.startswith("q_") else kv_dim
            found.append([part.name, per_token, per_token // head_dim])
        else:
            found.append([part.name, part.out_features, 1])
    return found


def adapted_parts(layout: Layout, names: Sequence[str]) -> tuple[list[Part], list[Part]] | None:
    """The linears peft adapts for `names` (its suffix rule) in one decoder layer and outside the layers (an
    untied head), in registration order; None when some name reaches nothing but linears, or nothing at all
    (the embeddings, a norm, a container, a tied head, a typo: the meta build decides or refuses it)."""

    def hit(part: Part, name: str) -> bool:
        return part.name == name or part.name.endswith("." + name)

    parts = (*layout.layer, *layout.outside)
    for name in names:
        reached = [part for part in parts if hit(part, name)]
        if not reached or any(part.kind != "linear" for part in reached):
            return None
    if not names:
        return None
    chosen = [[p for p in group if p.kind == "linear" and any(hit(p, n) for n in names)]
              for group in (layout.layer, layout.outside)]  # fmt: skip
    return chosen[0], chosen[1]


@dataclass(frozen=True)
class Adapted:
    """What LoRA reaches of a model, from its config: the linears adapted in one decoder layer and outside the
    layers (an untied head, a vision tower's), the parts trained in full (a projector, peft's
    `modules_to_save`), and for a vision-language model its targets in words."""

    layout: Layout
    layer: list[Part]
    outside: list[Part]
    saved: list[Part]
    summary: str = ""

    @property
    def modules(self) -> int:
        """How many modules of the whole model peft adapts."""
        return self.layout.num_layers * len(self.layer) + len(self.outside)


def adapted(
    config: Mapping[str, Any],
    targets: str | Sequence[str],
    moe: tuple[str, bool],
    vision: tuple[str, bool] | None = None,
) -> Adapted | None:
    """What `lora.target_modules` (mapped for the family, `resolve_lora_targets`; for a vision-language model
    with `vision` = (`lora.projector`, `lora.vision_tower`)) adapts; None when the rule cannot decide."""
    layout = model_layout(config)
    if layout is None or (vision is None) != (vision_family(dict(config)) is None):
        return None
    if vision is not None:
        return _vision_adapted(config, layout, targets, vision)
    try:
        mapped = resolve_lora_targets(config, targets, *moe)
    except ConfigError:
        return None  # the meta build refuses it, with the message
    if isinstance(mapped.target_modules, str) or mapped.target_parameters or mapped.modules_to_save:
        return None
    found = adapted_parts(layout, mapped.target_modules)
    return None if found is None else Adapted(layout, found[0], found[1], [])


def _vision_adapted(
    config: Mapping[str, Any], layout: Layout, targets: str | Sequence[str], vision: tuple[str, bool]
) -> Adapted | None:
    """`adapted` for a vision-language model, as `zerofit.models.vision.vision_lora_targets` tells peft: the
    language model's layer linears whose last name part the mapped targets end with (any other module named
    so: undecided), every linear of the vision tower's blocks with `lora.vision_tower`, the projector in full
    with `lora.projector = full`."""
    family = vision_family(dict(config))
    try:
        text = resolve_lora_targets({"model_type": family.text_model_type}, targets) if family else None
    except ConfigError:
        return None
    if text is None or isinstance(text.target_modules, str):
        return None
    leaves = {name.rsplit(".", 1)[-1] for name in text.target_modules}
    linears = [part for part in layout.layer if part.kind == "linear"]
    if not leaves or not leaves <= {part.name.rsplit(".", 1)[-1] for part in linears}:
        return None
    projector, tower = vision
    layer = [part for part in linears if part.name.rsplit(".", 1)[-1] in leaves]
    blocks = [
        p for p in layout.outside if p.vision and p.kind == "linear" and re.match(family.vision_tower, p.name)
    ]
    saved = [p for p in layout.outside if p.vision and re.match(family.projector, p.name)]
    saved = saved if projector == "full" else []
    summary = vision_lora_summary(text, tower and bool(blocks), bool(saved))
    return Adapted(layout, layer, blocks if tower else [], saved, summary)


def lora_entry(
    config: Mapping[str, Any],
    r: int,
    targets: str | Sequence[str],
    use_dora: bool,
    moe: tuple[str, bool],
    vision: tuple[str, bool] | None = None,
) -> dict[str, Any] | None:
    """`shapes._LoraEntry` (what peft adds per layer and outside the layers) from the config alone; None
    when the rule cannot decide it (the caller builds and adapts the model on the meta device)."""
    found = adapted(config, targets, moe, vision)
    if found is None:
        return None
    numels = [n for part in found.layer for n in _adapter_numels(part, r, use_dora)]
    outside_numels = [  # in registration order: a vision tower's adapters, then the projector's copy
        n
        for part in found.layout.outside
        for n in (_adapter_numels(part, r, use_dora) if part in found.outside else ())
        + (part.numels if part in found.saved else ())
    ]
    return {
        "layer_trainable_params": sum(numels),
        "outside_trainable_params": sum(outside_numels),
        "layer_targets": [_linear(part) for part in found.layer],
        "layer_numels": numels,
        "outside_numels": outside_numels,
        "adapted_params": [],
        "expert_factor_params": 0,
    }


def _adapter_numels(part: Part, r: int, use_dora: bool) -> tuple[int, ...]:
    """peft's trainable tensors on one adapted linear: lora_A, lora_B, and DoRA's magnitude vector."""
    return (r * part.in_features, part.out_features * r) + ((part.out_features,) if use_dora else ())
