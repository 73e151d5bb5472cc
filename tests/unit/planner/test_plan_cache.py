"""The planner's cache (`zerofit.core.derived_cache`): what `zerofit plan` reads instead of a meta-device build.

Its entries are data under a key that cannot go stale (the model's config, the settings, the library versions,
zerofit's source), checked before use: a malformed or altered entry is computed again, never trusted. The
plan's LoRA report (`zerofit.planner.lora_report`) is kept there, so a second plan of a config imports
neither peft nor transformers' modeling stack (tests/unit/test_lazy_imports.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import zerofit.core.derived_cache as cache
import zerofit.planner.lora_report as lora_report
from zerofit.catalogue.models import model_config_dict
from zerofit.config import load_config
from zerofit.config.schema import ZerofitConfig
from zerofit.core.derived_cache import cache_key, conforms
from zerofit.planner.lora_report import lora_targets_report

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def planner_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty `$ZEROFIT_CACHE/planner` of this test's own; the report goes through the meta build and the
    cache, as for a family the config-only rule does not decide (`planner.config_shapes`: the demo's is)."""
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(lora_report, "_from_config", lambda cfg, config: None)
    return tmp_path / "planner"


def _demo(*overrides: str) -> ZerofitConfig:
    return load_config(REPO / "configs" / "demo.yaml", list(overrides))


def _entry(cfg: ZerofitConfig) -> Path:
    """The file `cfg`'s LoRA report is cached in."""
    return cache._cache_dir() / f"{_key(cfg)}.json"


def _key(cfg: ZerofitConfig) -> str:
    """The cache key of `cfg`'s LoRA report."""
    config = lora_report._model_config(cfg)
    assert config is not None
    return lora_report._key(cfg, config)


def _no_build(cfg: ZerofitConfig) -> dict[str, Any]:
    raise AssertionError("the report was computed again instead of read from the cache")


def test_a_second_report_is_read_from_the_cache_not_built(
    planner_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _demo()
    first = lora_targets_report(cfg)
    assert first is not None and first["described"].startswith(
        "Llama: the listed modules: 15 modules adapted"
    )
    assert json.loads(_entry(cfg).read_text()) == first
    monkeypatch.setattr(lora_report, "_computed", _no_build)
    assert lora_targets_report(cfg) == first


@pytest.mark.parametrize(
    "change",
    [
        {"trainable_params": "40448"},  # a field of the wrong type
        {"adapted_modules": None},
        {"family": "Mistral", "summary": "Mistral: the listed modules"},  # not what the config maps to
        {"extra": 1},  # a field no report has
    ],
)
def test_a_malformed_or_altered_entry_is_computed_again_and_replaced(
    planner_cache: Path, change: dict[str, Any]
) -> None:
    cfg = _demo()
    first = lora_targets_report(cfg)
    assert first is not None
    _entry(cfg).write_text(json.dumps({**first, **change}))
    assert lora_targets_report(cfg) == first
    assert json.loads(_entry(cfg).read_text()) == first


def test_an_entry_that_is_not_json_is_computed_again(planner_cache: Path) -> None:
    cfg = _demo()
    first = lora_targets_report(cfg)
    _entry(cfg).write_text("{not json")
    assert lora_targets_report(cfg) == first


def test_the_key_holds_the_model_the_lora_section_the_libraries_and_zerofits_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = _key(_demo())
    assert _key(_demo("lora.r=8")) != base
    assert _key(_demo("lora.target_modules=all-linear")) != base
    assert _key(_demo("model.name_or_path=tiny-qwen2")) != base
    monkeypatch.setattr(cache, "_library_versions", lambda: {"transformers": "0.0", "peft": "0.0"})
    assert _key(_demo()) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache, "_source_digest", lambda: "an edited zerofit")
    assert _key(_demo()) != base


def test_a_meta_build_leaves_the_catalogued_config_and_so_the_keys_unchanged() -> None:
    # transformers rewrites Llama 3.1's `rope_scaling` dict in place; the catalogue's must stay as written, or
    # every key hashed after a build in the same process would differ from the next process's.
    from zerofit.models.meta import build_meta_model

    name = "meta-llama/Llama-3.1-8B"
    before = cache_key("model", 1, {"config": model_config_dict(name)})
    build_meta_model(name, 1, attn_implementation="eager")
    assert cache_key("model", 1, {"config": model_config_dict(name)}) == before


def test_conforms_checks_json_values_against_their_types() -> None:
    from zerofit.planner.shapes import LinearShape

    linear = {"name": "q_proj", "in_features": 8, "out_features": 8, "bias": False}
    assert conforms(linear, LinearShape)
    assert not conforms({**linear, "bias": 0}, LinearShape)  # JSON's 0 is not false
    assert not conforms({**linear, "in_features": True}, LinearShape)  # nor true an int
    assert not conforms({k: v for k, v in linear.items() if k != "bias"}, LinearShape)
    assert conforms([1, 2, 3], tuple[int, ...]) and not conforms([1, "2"], tuple[int, ...])
    assert conforms(["experts", "weight", 4], tuple[str, str, int]) and not conforms(
        ["x", 4], tuple[str, str, int]
    )
    assert conforms(None, str | None) and conforms(2, float) and not conforms("2", float)
    assert conforms({"a": 1}, dict[str, int]) and not conforms({"a": "1"}, dict[str, int])


BLOCKS = "MllamaVisionEncoderLayer,MllamaCrossAttentionDecoderLayer,MllamaSelfAttentionDecoderLayer"


def test_the_fsdp_block_class_is_read_from_the_cache_and_checked(
    planner_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An FSDP plan names the block class transformers' model class declares (its `_no_split_modules`): the
    # class's import costs seconds, so the answer is cached; an entry that is not class names is not used.
    import zerofit.engine_spec.render as render

    # (Llama 3.2 Vision: a family `catalogue.layouts` reads has its class named from its config alone, uncached.)
    model_cfg = model_config_dict("meta-llama/Llama-3.2-11B-Vision-Instruct")
    assert render.cached_layer_class(model_cfg) == BLOCKS
    key = cache_key("fsdp_layer_class", 1, {"config": model_cfg})
    assert json.loads((planner_cache / f"{key}.json").read_text()) == {"layer_class": BLOCKS}
    computed = render.decoder_layer_class
    monkeypatch.setattr(render, "decoder_layer_class", _no_build)
    assert render.cached_layer_class(model_cfg) == BLOCKS
    (planner_cache / f"{key}.json").write_text(json.dumps({"layer_class": "os.system('x')"}))
    monkeypatch.setattr(render, "decoder_layer_class", computed)
    assert render.cached_layer_class(model_cfg) == BLOCKS
