"""The opt-in speed levers: `train.compile` and `train.kernels`.

compile (CPU, inductor): a short one-process run with every layer compiled inside its activation checkpoint,
with the offload hooks and the tiled MLP, follows the eager run's loss curve within 1e-5 (fp32), and the
graph breaks dynamo met (the tiled MLP's RNG-state calls) are reported in every metrics row and the run's
compiled layers in run_info.json. kernels (Liger): refused where they cannot run (not installed, CPU, a
model they do not compute, with the lean norm), before any weight loads; on CUDA with Liger installed the
loss and gradients equal the eager model's in fp32 (skipped elsewhere). The planner's speed model assumes
no gain for either (1.0) and says so, and neither is an `auto` key the planner could turn on.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch

import zerofit
from config_helpers import DEMO_DATA, config, one_process_strategy
from launch_helpers import varied_length_data
from zerofit.core.errors import ConfigError, LaunchError
from zerofit.levers.kernels import hub_kernels_off, kernel_problems, liger_kernels_available
from zerofit.models.build import build_model
from zerofit.resolution import resolve

LEVERS = {"activation_checkpointing": True, "activation_offload": True, "tiled_mlp": 2}


def _curve(tmp_path: Path, name: str, data: Path, **train: Any) -> zerofit.RunResult:
    base = {
        "seed": 3,
        "batch": {"global_batch_size": 2, "micro_batch_size": 2},
        "distributed": {"strategy": "single"},
        "train": {"max_steps": 3, "precision": "fp32", **LEVERS},
        "optimizer": {"lr": 1e-2},
        "lora": {"dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 32},
        "checkpoint": {"save_final": False, "every_minutes": 0},
        "logging": {"console": False, "wandb": {"mode": "disabled"}},
    }
    return zerofit.train(
        base, output_dir=str(tmp_path / "runs"), run_name=name, **{f"train.{k}": v for k, v in train.items()}
    )


def test_compile_follows_the_eager_loss_curve_and_reports_its_graph_breaks(tmp_path: Path) -> None:
    data = varied_length_data(tmp_path / "varied.jsonl", 6)
    saved_env = dict(os.environ)  # train() sets the one-process rendezvous variables, as the launcher does
    try:
        eager = _curve(tmp_path, "eager", data)
        compiled = _curve(tmp_path, "compiled", data, compile=True)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    losses = [row["loss"] for row in compiled.metrics]
    assert len(losses) == 3 and losses[0] != losses[-1]
    assert losses == pytest.approx([row["loss"] for row in eager.metrics], rel=1e-5, abs=0)
    assert all("compile/graph_breaks" not in row for row in eager.metrics)
    # The tiled MLP's autograd function reads the RNG state (dynamo never traces it): breaks, counted.
    assert all(row["compile/graph_breaks"] > 0 for row in compiled.metrics)
    info = json.loads((compiled.run_dir / "run_info.json").read_text())
    assert info["compiled_layers"] == 2 and info["train"]["compile"] is True


def _resolve(**train: Any) -> Any:
    base = {
        "data": {"path": DEMO_DATA},
        "distributed": {"strategy": "single"},
        "batch": {"global_batch_size": 2, "micro_batch_size": 1},
    }
    return resolve(config(base, train=train), 1)


@pytest.mark.skipif(liger_kernels_available(), reason="Liger-Kernel is installed here")
def test_kernels_without_liger_are_refused_with_the_fix_before_any_load() -> None:
    with pytest.raises(ConfigError) as err:
        _resolve(kernels="liger", lean_norm=True)
    text = str(err.value)
    assert "pip install 'zerofit[liger]'" in text and "train.lean_norm = true" in text
    with pytest.raises(ConfigError, match=r"train.kernels = 'liger' needs Liger-Kernel.*zerofit\[liger\]"):
        build_model(config({"seed": 0}, train={"kernels": "liger"}))  # the Python path: refused before load


def test_kernels_on_a_cpu_rank_are_refused_with_the_fix() -> None:
    resolved = _resolve()
    cfg = resolved.config.model_copy(deep=True)
    cfg.train.kernels = "liger"  # as resolve() leaves it where Liger is installed
    from zerofit.recipe.assembly import _check_device

    with pytest.raises(
        LaunchError, match=r"train.kernels = 'liger' runs Liger's Triton kernels on CUDA.*cpu"
    ):
        _check_device(dataclasses.replace(resolved, config=cfg), one_process_strategy())


def test_kernels_refuse_models_they_do_not_compute() -> None:
    assert kernel_problems("liger", "llama", "silu") == [] and kernel_problems("none", "gemma", "gelu") == []
    problems = kernel_problems("liger", "gemma", "gelu_pytorch_tanh")
    assert len(problems) == 2 and "'gemma'" in problems[0] and "silu(gate) * up" in problems[1]


def test_speed_levers_are_opt_in_and_the_speed_model_claims_no_gain() -> None:
    from zerofit.engine_spec import render_spec
    from zerofit.planner.scenario import scenario_for
    from zerofit.planner.speed import predict_speed, speed_levers

    for key in ("compile", "kernels"):
        with pytest.raises(ConfigError, match=f"train.{key}"):
            config({}, train={key: "auto"})
    off, on = (_resolve(compile=c) for c in (False, True))
    scn_off, scn_on = (scenario_for(r.config, render_spec(r)) for r in (off, on))
    assert speed_levers(scn_off) is None and "compile x1.00" in str(speed_levers(scn_on))
    assert predict_speed(scn_on).tokens_per_s == predict_speed(scn_off).tokens_per_s
    liger = dataclasses.replace(scn_off, kernels="liger")
    assert "kernels liger x1.00" in str(speed_levers(liger))


@pytest.mark.skipif(
    not (torch.cuda.is_available() and liger_kernels_available()),
    reason="Liger's kernels need CUDA and Liger",
)
def test_liger_kernels_equal_the_eager_model_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    from zerofit.data import Example, collate

    # Liger's RoPE is a module-level swap: restored after the test, so later CPU tests run HF's again.
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)

    rows = [
        Example(list(range(60, 72)), [-100] * 5 + list(range(65, 72))),
        Example([1, 50, 51, 2], [-100, 50, 51, 2]),
    ]
    batch = {k: v.cuda() for k, v in collate(rows, pad_id=0).items()}
    out = {}
    for kernels in ("none", "liger"):
        model = build_model(
            config({"seed": 0, "lora": {"dropout": 0.0}}, train={"precision": "fp32", "kernels": kernels})
        )
        model.model.cuda()
        loss = model.model(**batch).loss
        loss.backward()
        out[kernels] = (
            loss.detach(),
            {n: p.grad for n, p in model.model.named_parameters() if p.grad is not None},
        )
    assert torch.allclose(out["liger"][0], out["none"][0], rtol=1e-5, atol=0)
    for name, grad in out["none"][1].items():
        scale = grad.abs().max().item()
        assert torch.allclose(out["liger"][1][name], grad, rtol=0, atol=1e-4 * scale + 1e-8), name


@pytest.mark.skipif(not liger_kernels_available(), reason="Liger-Kernel (and Triton) not installed here")
def test_liger_rebinds_the_norms_and_mlps_under_peft_and_keeps_the_adapters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Liger's module replacement needs no GPU (only its Triton kernels do, which `_check_device` refuses on a
    # CPU rank): zerofit's build path applies it to the model underneath peft; every decoder norm, the final
    # norm and every MLP get Liger's forward on the instance, the LoRA linears inside the MLPs stay (and
    # train), and Llama's RoPE function is swapped module-wide.
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    eager_rope = modeling_llama.apply_rotary_pos_emb
    built = build_model(config({"seed": 0}, train={"kernels": "liger"}))
    hf = built.model.get_base_model()
    rebound = sorted(n.removeprefix("model.") for n, m in hf.named_modules() if "forward" in vars(m))
    layers = range(hf.config.num_hidden_layers)
    expected = [
        f"layers.{i}.{part}"
        for i in layers
        for part in ("input_layernorm", "mlp", "post_attention_layernorm")
    ]
    assert rebound == sorted([*expected, "norm"])
    assert vars(hf.model.norm)["forward"].__func__.__qualname__ == "LigerRMSNorm.forward"
    assert vars(hf.model.layers[0].mlp)["forward"].__func__.__qualname__ == "LigerSwiGLUMLP.forward"
    assert hasattr(hf.model.layers[0].mlp.gate_proj, "lora_A")  # peft's adapted linear, called by Liger's MLP
    assert modeling_llama.apply_rotary_pos_emb is not eager_rope
    assert modeling_llama.apply_rotary_pos_emb.__name__ == "liger_rotary_pos_emb"


def test_liger_kernels_take_the_fused_loss_when_the_loss_is_unset_and_never_the_lean_norm() -> None:
    from zerofit.config.rules.model import fill_kernels

    unset = config({}, train={"kernels": "liger", "lean_norm": "auto"})
    notes = fill_kernels(unset)
    assert (unset.train.cross_entropy, unset.train.lean_norm, len(notes)) == ("fused_linear", False, 2)
    for kept in (
        config({}, train={"kernels": "liger", "cross_entropy": "chunked"}),  # the user's choice stays
        config(
            {"lora": {"target_modules": ["q_proj", "lm_head"]}}, train={"kernels": "liger"}
        ),  # adapted head
    ):
        fill_kernels(kept)
        assert kept.train.cross_entropy == "chunked"


# Loaders that transformers does not kernelize: a tokenizer, config or processor, and peft's `PeftModel`, which
# adapts a base already loaded (peft's `AutoPeftModel*` loads its base through transformers: it is a model load).
_NOT_A_MODEL_LOAD = ("Tokenizer", "Config", "Processor")


def test_every_model_load_keeps_the_hubs_kernelization_off() -> None:
    """`train.kernels` is the only kernel switch: every transformers model `from_pretrained` in src/ passes
    `hub_kernels_off()` (transformers 5 otherwise kernelizes from the Hub and re-kernelizes on each
    train()/eval(), dropping the lean norms; see `zerofit.levers.kernels`), and on transformers 5 it is off."""
    src = Path(zerofit.__file__).parent
    loads, missing = 0, []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained"):
                continue
            receiver = ast.get_source_segment(text, node.func.value) or ""
            if any(word in receiver for word in _NOT_A_MODEL_LOAD) or receiver.endswith("peft.PeftModel"):
                continue
            loads += 1
            spread = [k.value for k in node.keywords if k.arg is None and isinstance(k.value, ast.Call)]
            if not any(getattr(c.func, "id", None) == "hub_kernels_off" for c in spread):
                missing.append(f"{path.relative_to(src)}:{node.lineno}")
    assert loads >= 9 and missing == [], missing
    assert hub_kernels_off() == (
        {"use_kernels": False} if int(version("transformers").split(".")[0]) >= 5 else {}
    )
