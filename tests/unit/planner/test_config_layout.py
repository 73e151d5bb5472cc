"""The planner's facts from a model's config alone equal what the meta-device build measures, exactly.

A first `zerofit plan` of a dense model, a Mixtral / Qwen2-MoE / Qwen3-MoE model (routed experts fused) or a
Qwen2-VL / Qwen2.5-VL model (a vision tower and projector in front of the language model) reads its shapes,
its LoRA counts, its `LoRA:` report and its FSDP block class from the config (`zerofit.catalogue.layouts`,
`zerofit.planner.config_shapes`) instead of building it on the meta device through transformers and peft
(seconds of imports). These tests hold every field of every answer equal to the meta build's, for every
catalogue model (the tiny built-ins, the built-in pretrained model and the hub configs zerofit ships), every
LoRA target, MoE and vision choice, and every shipped config; and show that what the rule cannot decide is
left to the build (None), never guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zerofit.planner.lora_report as lora_report
from zerofit.catalogue.layouts import layout_model_types, model_layout
from zerofit.catalogue.models import CATALOGUE, model_config_dict
from zerofit.config import load_config
from zerofit.engine_spec.render import cached_layer_class, decoder_layer_class
from zerofit.planner.config_shapes import lora_entry, shape_entry
from zerofit.planner.shapes import built_lora_entry, compute_model_shape, shape_of_entry

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
DECIDED = [name for name, config in CATALOGUE.items() if model_layout(config) is not None]
# Targets and DoRA per case: the meanings, names, and the untied head (the demo adapts lm_head).
LORA_CASES = (
    ("all-linear", False),
    ("attention", True),
    ("mlp", False),
    (("q_proj", "v_proj", "lm_head"), True),
    (("q_proj", "down_proj"), False),
)
MOE_CASES = (("shared", False), ("none", False), ("all", False), ("shared", True))
VISION_CASES = (("frozen", False), ("full", False), ("frozen", True), ("full", True))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty planner cache: every meta-build answer here is measured, not read back."""
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))


def test_every_catalogue_model_of_a_family_the_rule_reads_is_read_from_its_config() -> None:
    undecided = [
        n for n, c in CATALOGUE.items() if c.get("model_type") in layout_model_types() and n not in DECIDED
    ]
    assert undecided == []
    assert {CATALOGUE[n]["model_type"] for n in DECIDED} == set(layout_model_types())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_shapes_from_the_config_equal_the_meta_builds(name: str) -> None:
    entry = shape_entry(model_config_dict(name), name)
    if name not in DECIDED:  # a family the rule does not read (LLaVA, Gemma 3 vision, ...): the build's
        assert entry is None
        return
    assert entry is not None
    assert shape_of_entry(entry, name) == compute_model_shape(name)  # every field


def _is_moe(config: dict[str, Any]) -> bool:
    """A mixture-of-experts model (Qwen-MoE's `num_experts`, Mixtral's `num_local_experts`)."""
    return "num_experts" in config or "num_local_experts" in config


def _cases(config: dict[str, Any]) -> list[tuple[Any, bool, tuple[str, bool], tuple[str, bool] | None]]:
    """Every LoRA case of a model: the targets and DoRA of `LORA_CASES`, by each MoE choice for a
    mixture-of-experts model and each vision choice (`lora.projector`, `lora.vision_tower`) for a
    vision-language model."""
    moes = MOE_CASES if _is_moe(config) else (("shared", False),)
    visions = VISION_CASES if "vision_config" in config else (None,)
    return [(t, dora, moe, v) for t, dora in LORA_CASES for moe in moes for v in visions]


def _left_to_the_build(config: dict[str, Any], targets: Any, moe: tuple[str, bool]) -> bool:
    """The cases the rule leaves to the meta build: routed experts or the router adapted (peft's parameter
    targeting, `modules_to_save`), a meaning that adapts nothing, an explicit name the model lacks or that
    reaches something other than a layer's linears (Phi-3's q_proj, a tied or a vision model's head, a MoE's
    fused `experts.down_proj`), `mlp` on a MoE model with no shared expert (refused)."""
    if moe[0] == "all" or moe[1]:
        return True
    names = set(targets) if isinstance(targets, tuple) else set()
    if "lm_head" in names and (config.get("tie_word_embeddings") or "vision_config" in config):
        return True
    if "q_proj" in names and config["model_type"] == "phi3":
        return True
    no_shared = moe[0] == "none" or "shared_expert_intermediate_size" not in config
    if targets == "mlp" and _is_moe(config) and no_shared:
        return True  # no dense or shared MLP adapted: the meaning adapts nothing, which the build refuses
    return "down_proj" in names and _is_moe(config)


@pytest.mark.slow
@pytest.mark.parametrize("name", DECIDED)
def test_lora_counts_from_the_config_equal_pefts_on_the_meta_build(name: str) -> None:
    config = model_config_dict(name)
    decided = 0
    for targets, dora, moe, vision in _cases(config):
        entry = lora_entry(config, 4, targets, dora, moe, vision)
        if entry is None:
            assert _left_to_the_build(config, targets, moe), (targets, dora, moe, vision)
            continue
        decided += 1
        built = built_lora_entry(name, 4, targets, dora, moe, vision)
        assert entry == built, (targets, dora, moe, vision)
    assert decided >= 3  # all-linear, attention and mlp at least


def _lora_configs() -> list[str]:
    return [name for name in CONFIGS if load_config(REPO / "configs" / name, []).lora.enabled]


@pytest.mark.slow
@pytest.mark.parametrize("name", _lora_configs())
def test_every_shipped_configs_lora_shape_and_report_from_the_config_equal_the_meta_builds(name: str) -> None:
    cfg = load_config(REPO / "configs" / name, [])
    config = model_config_dict(cfg.model.name_or_path)
    lora = cfg.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    moe = (lora.moe_experts, lora.train_router)
    vision = (lora.projector, lora.vision_tower) if "vision_config" in config else None
    entry = lora_entry(config, lora.r, targets, lora.use_dora, moe, vision)
    report = lora_report._from_config(cfg, config)
    assert entry == built_lora_entry(cfg.model.name_or_path, lora.r, targets, lora.use_dora, moe, vision)
    assert report is not None and report == lora_report._computed(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["lora.projector=full"],
        ["lora.vision_tower=true", "lora.use_dora=true"],
        ["lora.target_modules=[q_proj,down_proj]"],
    ],
)
def test_a_vision_models_lora_report_from_the_config_equals_pefts_for_every_vision_choice(
    overrides: list[str],
) -> None:
    cfg = load_config(REPO / "configs" / "demo-vlm.yaml", overrides)
    report = lora_report._from_config(cfg, model_config_dict(cfg.model.name_or_path))
    assert report is not None and report == lora_report._computed(cfg)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_is_read_from_its_config(name: str) -> None:
    cfg = load_config(REPO / "configs" / name, [])
    config = model_config_dict(cfg.model.name_or_path)
    assert shape_entry(config, cfg.model.name_or_path) is not None
    assert not cfg.lora.enabled or lora_report._from_config(cfg, config) is not None


@pytest.mark.parametrize("name", DECIDED)
def test_the_fsdp_block_class_from_the_config_is_the_model_classs(name: str) -> None:
    assert cached_layer_class(CATALOGUE[name]) == decoder_layer_class(CATALOGUE[name])


def _without(config: dict[str, Any], key: str) -> dict[str, Any]:
    """`config` without `key` (a nested config whose class default the rule must not guess)."""
    return {k: v for k, v in config.items() if k != key}


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("tiny-qwen3", {"head_dim": None}),  # Qwen3's default head_dim is not hidden / heads
        ("tiny-llama", {"num_key_value_heads": None}),  # a key whose default the rule does not guess
        ("tiny-qwen2", {"use_sliding_window": True}),  # sliding layers past max_window_layers only
        ("tiny-mistral", {"attention_bias": True}),  # Mistral's projections do not follow it
        ("tiny-mistral", {"layer_types": ["full_attention", "sliding_attention"]}),
        ("tiny-qwen2", {"mlp_bias": True}),
        ("tiny-gemma2", {"attn_logit_softcapping": None}),  # Gemma 2's default caps are not "none"
        ("tiny-llama", {"architectures": ["LlamaForSequenceClassification"]}),
        ("tiny-qwen2-moe", {"mlp_only_layers": [1]}),  # a dense layer among the sparse ones
        ("tiny-qwen2-moe", {"decoder_sparse_step": 2}),
        ("tiny-qwen2-moe", {"moe_intermediate_size": None}),  # an expert width the rule does not guess
        ("tiny-qwen2-moe", {"use_sliding_window": True}),
        ("tiny-qwen3-moe", {"decoder_sparse_step": 2}),
        ("tiny-mixtral", {"num_local_experts": None}),
        ("tiny-mixtral", {"layer_types": ["full_attention", "sliding_attention"]}),
        ("tiny-qwen2-vl", {"text_config": None}),  # a flat (older) config: transformers splits it
        ("tiny-qwen2-vl", {"tie_word_embeddings": None}),
        ("tiny-qwen2-vl", {"architectures": ["Qwen2VLForCausalLM"]}),
        (
            "tiny-qwen2-vl",
            {"vision_config": _without(CATALOGUE["tiny-qwen2-vl"]["vision_config"], "mlp_ratio")},
        ),
        ("tiny-qwen2-vl", {"text_config": {**CATALOGUE["tiny-qwen2-vl"]["text_config"], "head_dim": 32}}),
    ],
)
def test_what_the_rule_cannot_decide_is_left_to_the_meta_build(name: str, change: dict[str, Any]) -> None:
    config = {**CATALOGUE[name], **change}
    config = {k: v for k, v in config.items() if v is not None}
    assert model_layout(config) is None
    assert (
        shape_entry(config, name) is None
        and lora_entry(config, 4, "all-linear", False, ("shared", False)) is None
    )


def test_targets_beyond_a_layers_linears_are_left_to_the_meta_build() -> None:
    llama, qwen2 = CATALOGUE["tiny-llama"], CATALOGUE["tiny-qwen2"]
    for targets in (("embed_tokens",), ("q_proj", "norm"), ("mlp",), ("q_proj", "no_such")):
        assert lora_entry(llama, 4, targets, False, ("shared", False)) is None, targets
    assert lora_entry(qwen2, 4, ("lm_head",), False, ("shared", False)) is None  # tied to the embeddings
