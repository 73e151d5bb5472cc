"""The renderer: every preset x dp {1, 2, 8} x precision {bf16, fp16, fp32} against golden files (byte for
byte, as the run directory writes them), accepted by the engine itself (DeepSpeed's `DeepSpeedConfig`;
FSDP: a real `fully_shard` on the tiny model); and the one spec that the engine, the planner and the
printed plan all read.

Regenerate the golden files after a deliberate change with `ZEROFIT_UPDATE_GOLDEN=1 pytest tests/unit/engine_spec/test_render.py`
and review the diff: it is exactly what every engine will receive differently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _deepspeed_world import deepspeed_config_at

from zerofit.catalogue.presets import list_presets
from zerofit.config import load_config
from zerofit.core.errors import ConfigError, LaunchError
from zerofit.engine_spec import DeepSpeedSpec, engine_config_filename, render_spec
from zerofit.engine_spec.deepspeed_keys import FP16_DYNAMIC_LOSS_SCALING
from zerofit.engine_spec.render import decoder_layer_class
from zerofit.resolution import ResolvedConfig, resolve

REPO = Path(__file__).resolve().parents[3]
GOLDEN_DIR = Path(__file__).parents[1] / "golden"
UPDATE_GOLDEN = os.environ.get("ZEROFIT_UPDATE_GOLDEN") == "1"
DPS = (1, 2, 8)
PRECISIONS = ("bf16", "fp16", "fp32")
DS_PRESETS = [n for n, p in list_presets().items() if p.strategy == "deepspeed"]
FSDP_PRESETS = [n for n, p in list_presets().items() if p.strategy == "fsdp"]
# Golden files: one per preset, plus the preset-less engines.
ENGINES = [*list_presets(), "ddp", "single"]


def resolved_for(engine: str, dp: int, precision: str, *overrides: str) -> ResolvedConfig:
    """The default config on `engine` (a preset name, `ddp` or `single`), global 32 = micro 2 x ... x dp."""
    if engine in ("ddp", "single"):
        choice = [f"distributed.strategy={engine}", "distributed.preset=null"]
    else:
        choice = [f"distributed.strategy={list_presets()[engine].strategy}", f"distributed.preset={engine}"]
    cfg = load_config(
        None,
        [
            *choice,
            f"train.precision={precision}",
            "batch.global_batch_size=32",
            "batch.micro_batch_size=2",
            f"data.path={REPO / 'data' / 'demo.jsonl'}",
            *overrides,
        ],
    )
    return resolve(cfg, dp)


def _cases(engine: str) -> str:
    """Every case of one engine, serialized as the run directory writes an engine file (key order kept)."""
    dps = (1,) if engine == "single" else DPS
    cases = {
        f"dp{dp}-{p}": render_spec(resolved_for(engine, dp, p)).to_json() for dp in dps for p in PRECISIONS
    }
    return json.dumps(cases, indent=2) + "\n"


@pytest.mark.parametrize("engine", ENGINES)
def test_rendering_matches_golden_file_byte_for_byte(engine: str) -> None:
    rendered = _cases(engine)
    golden = GOLDEN_DIR / f"{engine}.json"
    if UPDATE_GOLDEN:
        GOLDEN_DIR.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.is_file(), f"missing {golden}; create it with ZEROFIT_UPDATE_GOLDEN=1"
    assert golden.read_text() == rendered, (
        f"{golden.name} differs from the renderer's output; if the change is intended, rerun with "
        "ZEROFIT_UPDATE_GOLDEN=1 and review the diff"
    )


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dp", DPS)
@pytest.mark.parametrize("preset", DS_PRESETS)
def test_deepspeed_accepts_every_rendered_preset(preset: str, dp: int, precision: str) -> None:
    resolved = resolved_for(preset, dp, precision)
    rendered = render_spec(resolved).to_json()
    ds = deepspeed_config_at(rendered, dp)
    plan = resolved.batch
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.grad_accum_steps,
    )
    assert ds.zero_optimization_stage == list_presets()[preset].body["zero_optimization"]["stage"]
    assert ds.float16_config.enabled == (precision == "fp16")
    assert ds.bfloat16_config.enabled == (precision == "bf16")
    if precision == "fp16":
        assert ds.float16_config.loss_scale == 0  # dynamic loss scaling
        assert ds.float16_config.initial_scale_power == 16
    assert ds.gradient_clipping == 1.0
    assert ds.steps_per_print == rendered["steps_per_print"] >= 10**9
    assert not (ds.monitor_config.tensorboard.enabled or ds.monitor_config.wandb.enabled)
    assert not ds.monitor_config.csv_monitor.enabled
    assert ds.zero_config.reduce_bucket_size == 64 * 64  # tiny-llama hidden size 64
    if ds.zero_optimization_stage == 3:
        assert ds.zero_config.prefetch_bucket_size == int(0.9 * 64 * 64)
        assert ds.zero_config.param_persistence_threshold == 640
    if preset.endswith("_offload"):
        # optimizer.name=adamw under optimizer offload: DeepSpeed's CPU Adam runs the step.
        assert ds.optimizer_name == "adamw"
        assert ds.optimizer_params["lr"] == resolved.effective_lr
    else:
        assert ds.optimizer_name is None and ds.zero_allow_untested_optimizer


def _run_fsdp_probe(plans: list[dict[str, Any]], tmp_path: Path) -> list[dict[str, Any]]:
    plans_file = tmp_path / "plans.json"
    plans_file.write_text(json.dumps(plans))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "_fsdp_probe.py"), str(plans_file)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_fsdp_plans_drive_a_real_fully_shard(tmp_path: Path) -> None:
    """Every FSDP plan at dp 1 is applied with `fully_shard` in one process; dp 2 and 8 plans differ only in
    the mesh size and the batch numbers (one process cannot build an 8-rank mesh)."""
    plans = {
        (preset, dp, p): render_spec(resolved_for(preset, dp, p)).to_json()
        for preset in FSDP_PRESETS
        for dp in DPS
        for p in PRECISIONS
    }
    for (preset, dp, p), plan in plans.items():
        base = plans[(preset, 1, p)]
        assert plan["mesh"]["shape"] == [dp]
        assert plan["train_batch"]["dp_size"] == dp
        assert plan["train_batch"]["grad_accum_steps"] == 32 // (2 * dp)
        same = {k: v for k, v in plan.items() if k not in ("mesh", "train_batch", "gradient_accumulation")}
        assert same == {
            k: v for k, v in base.items() if k not in ("mesh", "train_batch", "gradient_accumulation")
        }

    dp1 = [plan for (_, dp, _), plan in plans.items() if dp == 1]
    results = _run_fsdp_probe(dp1, tmp_path)
    assert len(results) == len(dp1) == 2 * len(PRECISIONS)
    for plan, result in zip(dp1, results, strict=True):
        assert result["preset"] == plan["preset"]
        assert result["sharded_layers"] == 2  # both tiny-llama decoder layers found by class name
        assert result["root_is_fsdp"]
        assert result["logits_dtype"] == plan["mixed_precision"]["output_dtype"]
        assert result["all_grads"]
        assert result["grad_dtypes"] == ["float32"]  # sharded fp32 master gradients
        assert result["grad_devices"] == ["cpu"]
        assert result["params_changed"] == result["n_params"]


# ------------------------------------------------------------------------------------- specific rules


def test_offload_with_a_client_optimizer_keeps_the_client_optimizer() -> None:
    for preset in ("zero2_offload", "zero3_offload"):
        resolved = resolved_for(preset, 2, "bf16", "optimizer.name=adamw_8bit")
        spec = render_spec(resolved)
        rendered = spec.to_json()
        assert not spec.builds_optimizer and spec.offloads_optimizer
        assert rendered["zero_allow_untested_optimizer"] is True
        assert rendered["zero_force_ds_cpu_optimizer"] is False
        ds = deepspeed_config_at(rendered, 2)
        assert ds.optimizer_name is None and ds.zero_force_ds_cpu_optimizer is False


def test_non_offload_presets_never_force_the_cpu_optimizer_flag() -> None:
    rendered = render_spec(resolved_for("zero2", 1, "bf16")).to_json()
    assert "zero_force_ds_cpu_optimizer" not in rendered and "optimizer" not in rendered


def test_deepspeed_optimizer_block_uses_the_effective_lr() -> None:
    resolved = resolved_for(
        "zero3_offload",
        1,
        "bf16",
        "optimizer.lr=1e-3",
        "optimizer.lr_scaling=linear",
        "optimizer.base_batch_size=8",
        "optimizer.betas=[0.9,0.95]",
        "optimizer.weight_decay=0.1",
        "optimizer.eps=1e-6",
    )
    block = render_spec(resolved).to_json()["optimizer"]
    assert block == {
        "type": "AdamW",
        "params": {"lr": pytest.approx(4e-3), "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1},
    }


def test_clipping_off_is_zero() -> None:
    rendered = render_spec(resolved_for("zero1", 1, "bf16", "train.max_grad_norm=null")).to_json()
    assert rendered["gradient_clipping"] == 0.0


def test_fp16_uses_dynamic_loss_scaling() -> None:
    rendered = render_spec(resolved_for("zero2", 1, "fp16")).to_json()
    assert rendered["fp16"] == {"enabled": True, **FP16_DYNAMIC_LOSS_SCALING}
    assert rendered["fp16"]["loss_scale"] == 0
    assert rendered["bf16"] == {"enabled": False}


def test_bucket_sizes_follow_the_model_width() -> None:
    rendered = render_spec(
        resolved_for("zero3", 8, "bf16", "model.name_or_path=meta-llama/Llama-2-7b-hf")
    ).to_json()
    zero = rendered["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 40960
    stage2 = render_spec(resolved_for("zero2", 8, "bf16", "model.name_or_path=Qwen/Qwen2.5-7B")).to_json()
    assert stage2["zero_optimization"]["reduce_bucket_size"] == 3584 * 3584
    assert "stage3_prefetch_bucket_size" not in stage2["zero_optimization"]


def test_unknown_model_shape_is_one_paragraph_naming_the_known_ids() -> None:
    # The tests run offline (HF_HUB_OFFLINE=1): said at once, not after the hub's retries.
    with pytest.raises(
        LaunchError, match=r"offline mode is on .* trains offline here: the built-in models tiny-llama"
    ):
        render_spec(resolved_for("zero2", 1, "bf16", "model.name_or_path=someone/unknown-7b")).to_json()


@pytest.mark.parametrize(
    ("model_cfg", "layer"),
    [
        ({"model_type": "llama"}, "LlamaDecoderLayer"),
        ({"model_type": "mistral"}, "MistralDecoderLayer"),
        ({"model_type": "qwen2"}, "Qwen2DecoderLayer"),
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "GemmaDecoderLayer"),
    ],
)
def test_decoder_layer_class(model_cfg: dict[str, Any], layer: str) -> None:
    assert decoder_layer_class(model_cfg) == layer


@pytest.mark.parametrize(
    ("name", "blocks"),
    [
        ("tiny-qwen2-vl", ["Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"]),
        ("tiny-gemma3-vl", ["Gemma3DecoderLayer", "SiglipEncoderLayer"]),
        ("tiny-llava", ["CLIPEncoderLayer", "LlamaDecoderLayer"]),
        ("tiny-smolvlm", ["SmolVLMVisionAttention", "LlamaDecoderLayer"]),
    ],
)
def test_a_vision_model_shards_its_vision_blocks_and_decoder_layers(name: str, blocks: list[str]) -> None:
    """FSDP2's units of a vision-language model: the blocks its class and its tower's and language model's
    classes declare whole (Gemma 3's class names only its decoder layer, LLaVA's none)."""
    from zerofit.catalogue.vision_models import TINY_VLM_CONFIGS

    declared = decoder_layer_class(TINY_VLM_CONFIGS[name]).split(",")
    assert set(blocks) <= set(declared) and len(declared) == len(set(declared))


def test_decoder_layer_class_unknown() -> None:
    with pytest.raises(ConfigError, match="decoder layer"):
        decoder_layer_class({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]})


def test_fsdp_plan_states_sync_policy_and_offload() -> None:
    plain = render_spec(resolved_for("fsdp", 2, "bf16")).to_json()
    offload = render_spec(resolved_for("fsdp_offload", 2, "bf16"), device_type="cuda").to_json()
    assert plain["gradient_accumulation"]["sync"] == "boundary_only"
    assert offload["gradient_accumulation"]["sync"] == "every_micro_step"
    assert plain["cpu_offload"] is False and offload["cpu_offload"] is True
    assert offload["cpu_offload_pin_memory"] is True and offload["mesh"]["device_type"] == "cuda"
    assert plain["mixed_precision"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": "bfloat16",
    }
    assert plain["wrap"] == {"layer_class": "LlamaDecoderLayer", "root": True}
    assert plain["gradient_divide_factor"] == 1.0 and "global" in plain["notes"]
    assert plain["train_batch"] == {
        "global_batch_size": 32,
        "micro_batch_size": 2,
        "grad_accum_steps": 8,
        "dp_size": 2,
    }


def test_ddp_and_single_plans() -> None:
    ddp = render_spec(resolved_for("ddp", 2, "fp16")).to_json()
    assert ddp["autocast_dtype"] == "float16" and ddp["grad_scaler"] is True
    assert ddp["gradient_accumulation"]["sync"] == "boundary_only"
    single = render_spec(resolved_for("single", 1, "fp32", "train.max_grad_norm=0.5")).to_json()
    assert single["autocast_dtype"] is None and single["grad_scaler"] is False
    assert single["max_grad_norm"] == 0.5 and single["train_batch"]["grad_accum_steps"] == 16


def test_engine_config_filenames() -> None:
    assert engine_config_filename("deepspeed") == "ds_config.json"
    assert engine_config_filename("fsdp") == "fsdp.json"
    assert engine_config_filename("ddp") == engine_config_filename("single") == "engine.json"
    with pytest.raises(ValueError, match="unknown strategy"):
        engine_config_filename("horovod")


def test_rendering_is_torch_free() -> None:
    code = (
        "import sys, zerofit.engine_spec, zerofit.commands.plan, zerofit.commands.presets, zerofit.cli; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_an_uncatalogued_hub_id_is_read_from_the_hf_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hub id outside the catalogue plans from its config.json in the local HF cache (no weights, no network).
    from transformers import LlamaConfig

    from zerofit.catalogue.models import TINY_LLAMA_CONFIG, model_config_dict

    cfg = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k not in ("architectures", "model_type")}
    folder = tmp_path / "cache" / "models--someone--cached-llama" / "snapshots" / "abc"
    folder.mkdir(parents=True)
    LlamaConfig(**{**cfg, "hidden_size": 96}).save_pretrained(folder)
    (tmp_path / "cache" / "models--someone--cached-llama" / "refs").mkdir()
    (tmp_path / "cache" / "models--someone--cached-llama" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    assert model_config_dict("someone/cached-llama")["hidden_size"] == 96


# ------------------------------------------------------------------------------------- one spec, every reader


def test_deepspeed_spec_states_its_facts_once() -> None:
    offload = render_spec(resolved_for("zero3_offload", 2, "bf16"))
    assert isinstance(offload, DeepSpeedSpec)
    assert (offload.zero_stage, offload.offload_optimizer, offload.offload_params) == (3, True, True)
    assert offload.builds_optimizer and offload.engine_optimizer == "AdamW"
    assert offload.describe_optimizer("adamw").startswith("DeepSpeed AdamW")
    assert offload.grad_divide_factor == 2.0 and offload.sync.every_micro_step
    zero1 = render_spec(resolved_for("zero1", 2, "bf16"))
    assert zero1.describe_grad_sync() == "once per window, at the boundary (ZeRO-1)"
    assert (
        render_spec(resolved_for("zero1", 1, "bf16")).describe_grad_sync() == "none (one data-parallel rank)"
    )


def _edited_preset(monkeypatch: pytest.MonkeyPatch, name: str, **changes: Any) -> None:
    """Make preset `name` read as if its file said `changes` (zero_optimization keys as zero__KEY)."""
    import dataclasses

    import zerofit.catalogue.presets as presets_module

    presets = dict(list_presets())
    body = json.loads(json.dumps(presets[name].body))
    for key, value in changes.items():
        section, _, leaf = key.partition("__")
        if leaf:
            body[section][leaf] = value
        else:
            body[section] = value
    presets[name] = dataclasses.replace(presets[name], body=body)
    monkeypatch.setattr(presets_module, "list_presets", lambda: presets)


def test_planner_and_engine_read_the_same_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """One preset value changed: the engine config, the planner's scenario and its estimate all follow."""
    from zerofit.planner.estimate import estimate
    from zerofit.planner.scenario import scenario_for
    from zerofit.planner.state import Place, StateKind, model_state

    resolved = resolved_for("zero2", 2, "bf16", "model.name_or_path=meta-llama/Llama-2-7b-hf")
    before = render_spec(resolved)
    scn_before = scenario_for(resolved.config, before)
    assert (scn_before.zero_stage, scn_before.offload_optimizer) == (2, False)

    _edited_preset(monkeypatch, "zero2", zero_optimization__offload_optimizer={"device": "cpu"})
    after = render_spec(resolved)
    scn_after = scenario_for(resolved.config, after)
    # The engine receives the offload ...
    assert after.to_json()["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    # ... DeepSpeed now builds its CPU Adam, and the planner sees the same: the state moves to the host.
    assert after.builds_optimizer and scn_after.offload_optimizer and scn_after.ds_builds_optimizer
    est_before, est_after = estimate(scn_before), estimate(scn_after)
    assert est_after.tensors_gib < est_before.tensors_gib
    assert est_after.host_ram_gib > est_before.host_ram_gib
    host_optimizer = model_state(scn_after).bytes_of(StateKind.OPTIMIZER_STATE, place=Place.HOST)
    assert (
        host_optimizer > 0
        and model_state(scn_before).bytes_of(StateKind.OPTIMIZER_STATE, place=Place.HOST) == 0
    )

    _edited_preset(monkeypatch, "zero2", zero_optimization__stage=3)
    stage3 = render_spec(resolved)
    assert (
        stage3.to_json()["zero_optimization"]["stage"] == 3
        and scenario_for(resolved.config, stage3).zero_stage == 3
    )
    assert "stage3_prefetch_bucket_size" in stage3.to_json()["zero_optimization"]  # sized for stage 3 too
