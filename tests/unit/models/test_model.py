"""The model pipeline: dtype rule, LoRA freezing, checkpointing equivalence, QLoRA / 8-bit on CPU, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from config_helpers import config
from zerofit.config import ZerofitConfig, load_config
from zerofit.core.errors import ConfigError
from zerofit.data import Example, collate
from zerofit.models.build import BuiltModel, build_model, count_parameters
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.resolution import resolve

REPO = Path(__file__).resolve().parents[3]
BATCH = collate(
    [
        Example([1, 40, 41, 42, 43, 44, 2], [-100, -100, -100, 42, 43, 44, 2]),
        Example([1, 50, 51, 2], [-100, -100, 51, 2]),
    ],
    pad_id=0,
)


def _cfg(**sections: dict[str, Any]) -> ZerofitConfig:
    """A tiny-llama config; LoRA dropout off so forward passes are deterministic."""
    return config({"seed": 0, "lora": {"dropout": 0.0}}, **sections)


def _is_adapter(name: str) -> bool:
    return "lora_" in name


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _backward(model: torch.nn.Module) -> torch.Tensor:
    loss = model(**BATCH).loss
    loss.backward()
    return loss.detach()


@pytest.fixture(scope="module")
def lora_bf16() -> BuiltModel:
    return build_model(_cfg(train={"precision": "bf16"}))


def test_lora_trains_only_adapters(lora_bf16: BuiltModel) -> None:
    model = lora_bf16.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(_is_adapter(n) for n in trainable)
    # all-linear: q, k, v, o, gate, up, down in both layers, A and B each; never lm_head.
    assert len(trainable) == 2 * 7 * 2 and not any("lm_head" in n for n in trainable)
    assert (lora_bf16.total_params, lora_bf16.trainable_params) == count_parameters(model)
    assert lora_bf16.trainable_params == sum(p.numel() for n, p in model.named_parameters() if n in trainable)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _backward(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable  # every changed tensor is an adapter
    assert any("lora_B" in n for n in changed)


def test_dtype_rule_lora_half_base_fp32_adapters(lora_bf16: BuiltModel) -> None:
    assert lora_bf16.load_dtype == torch.bfloat16
    for name, p in lora_bf16.model.named_parameters():
        assert p.dtype == (torch.float32 if _is_adapter(name) else torch.bfloat16), name
    assert lora_bf16.model.training
    assert lora_bf16.model.get_base_model().config.use_cache is False


@pytest.mark.parametrize(
    ("precision", "lora", "expected"),
    [("fp32", True, torch.float32), ("fp16", True, torch.float16), ("bf16", False, torch.float32)],
)
def test_dtype_rule(precision: str, lora: bool, expected: torch.dtype) -> None:
    built = build_model(_cfg(train={"precision": precision}, lora={"enabled": lora}))
    assert built.load_dtype == expected
    base = [p for n, p in built.model.named_parameters() if not _is_adapter(n)]
    assert {p.dtype for p in base} == {expected}
    if not lora:  # full fine-tuning: every parameter trains, in fp32 (the engine does mixed precision)
        assert built.trainable_params == built.total_params == sum(p.numel() for p in base)
        assert all(p.requires_grad for p in base)


def _saved_bytes(model: torch.nn.Module) -> int:
    """Bytes autograd keeps for backward during one forward (deduplicated by storage)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**BATCH).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _checkpointed_flags(model: torch.nn.Module) -> list[bool]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_activation_checkpointing_same_loss_and_grads(lora: bool) -> None:
    """Full (`true`) and selective (the first 1 of tiny-llama's 2 layers) checkpointing give the plain
    model's loss and gradients (fp32, within 1e-6), and really keep fewer bytes for backward."""
    settings = {"none": False, "all": True, "first-1": 1}  # (True == 1 as a dict key: named instead)
    built = {
        name: build_model(
            _cfg(train={"precision": "fp32", "activation_checkpointing": value}, lora={"enabled": lora})
        ).model
        for name, value in settings.items()
    }
    assert {n: _checkpointed_flags(m) for n, m in built.items()} == {
        "none": [False, False],
        "all": [True, True],
        "first-1": [True, False],
    }
    losses = {name: _backward(model) for name, model in built.items()}
    grads = {name: _grads(model) for name, model in built.items()}
    for name in ("all", "first-1"):
        assert torch.allclose(losses["none"], losses[name], atol=1e-6, rtol=0)
        assert grads[name].keys() == grads["none"].keys() and grads["none"]
        for param in grads["none"]:
            assert torch.allclose(grads["none"][param], grads[name][param], atol=1e-6, rtol=1e-5), param
    # And checkpointing is really on: full keeps far fewer bytes, one layer of two in between.
    saved = {name: _saved_bytes(model) for name, model in built.items()}
    assert saved["all"] < 0.7 * saved["none"]
    assert saved["all"] < saved["first-1"] < saved["none"]


@pytest.mark.parametrize("load_in", ["4bit", "8bit"])
def test_quantized_lora_backward_on_cpu(load_in: str) -> None:
    unquantized_total = count_parameters(build_model(_cfg(train={"precision": "bf16"})).model)[0]
    built = build_model(
        _cfg(train={"precision": "bf16", "activation_checkpointing": True}, quantization={"load_in": load_in})
    )
    model = built.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("Linear4bit" if load_in == "4bit" else "Linear8bitLt") in kinds
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(_is_adapter(n) for n in trainable)
    assert built.total_params == unquantized_total  # packed 4-bit weights counted as the values they hold
    loss = _backward(model)
    assert torch.isfinite(loss)
    grads = _grads(model)
    assert set(grads) == trainable
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)


def test_tokenizer_without_pad_pads_with_eos(tmp_path: Path) -> None:
    folder = tmp_path / "no-pad"
    shutil.copytree(ensure_tiny_llama(0), folder)
    tok_cfg = folder / "tokenizer_config.json"
    tok_cfg.write_text(
        json.dumps({k: v for k, v in json.loads(tok_cfg.read_text()).items() if k != "pad_token"})
    )
    built = build_model(_cfg(model={"name_or_path": str(folder)}, train={"precision": "fp32"}))
    assert built.tokenizer.pad_token == built.tokenizer.eos_token == "</s>"


def test_8bit_with_fsdp_is_refused_with_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    overrides = ["quantization.load_in=8bit", "distributed.strategy=fsdp", "distributed.preset=fsdp"]
    with pytest.raises(ConfigError) as err:
        resolve(load_config(REPO / "configs" / "demo.yaml", overrides), 2)
    msg = str(err.value)
    assert "quantization.load_in = '8bit'" in msg and "load_in=4bit" in msg and "deepspeed" in msg
    # QLoRA (4-bit) under FSDP2 and 8-bit under ZeRO-3 were checked to train, so they resolve.
    resolve(
        load_config(
            REPO / "configs" / "demo.yaml",
            ["quantization.load_in=4bit", "distributed.strategy=fsdp", "distributed.preset=fsdp"],
        ),
        2,
    )
    resolve(
        load_config(
            REPO / "configs" / "demo.yaml", ["quantization.load_in=8bit", "distributed.preset=zero3"]
        ),
        2,
    )
