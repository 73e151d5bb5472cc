"""The lean RMSNorm (`train.lean_norm`, zerofit.levers.norms) against Hugging Face's own RMSNorm classes.

Forward bit-identical to each known class (fp32, bf16, a bf16 input with an fp32 weight, under autocast);
input and weight gradients equal within 1e-5 relative in fp32 (bf16: its own rounding), with the backward
split into ragged token chunks; it saves the input in its dtype plus one fp32 rstd per token, where HF saves
the fp32 upcast (and the normalized output when the weight trains); a norm class it does not know is refused.
The whole-model checks (tiny-llama, checkpointing, LoRA, the loss curve) are in test_memory_levers.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from zerofit.core.errors import ConfigError
from zerofit.levers.norms import (
    KNOWN_RMSNORMS,
    LEAN_NORM_MODEL_TYPES,
    check_lean_norm,
    enable_lean_norm,
    lean_rms_norm,
)

HIDDEN, EPS = 64, 1e-5
CLASSES = [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm]
DTYPES = {  # (input dtype, weight dtype, autocast)
    "fp32": (torch.float32, torch.float32, False),
    "bf16": (torch.bfloat16, torch.bfloat16, False),
    "bf16-input-fp32-weight": (torch.bfloat16, torch.float32, False),
    "fp32-under-bf16-autocast": (torch.float32, torch.float32, True),
}


def _norm(cls: type, weight_dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = cls(HIDDEN, eps=EPS).to(weight_dtype)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


def _run(fn: Any, x: torch.Tensor, weight: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and weight gradient of `fn(x)` (a norm using `weight`) on a copy of x."""
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    torch.manual_seed(1)
    out.backward(torch.randn(out.shape).to(out.dtype))
    assert x.grad is not None and weight.grad is not None
    return out.detach(), x.grad, weight.grad


def test_every_known_class_is_tested() -> None:
    assert {cls.__name__ for cls in CLASSES} == KNOWN_RMSNORMS


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_forward_is_bit_identical_and_gradients_match(cls: type, dtypes: str) -> None:
    x_dtype, w_dtype, autocast = DTYPES[dtypes]
    norm, twin = _norm(cls, w_dtype), _norm(cls, w_dtype)
    x = (torch.randn(3, 7, HIDDEN) * 3).to(x_dtype)
    # 4 tokens per chunk: 21 tokens are 6 chunks, the last one ragged.
    lean = _run(
        lambda x: lean_rms_norm(x, twin.weight, EPS, chunk_elements=4 * HIDDEN), x, twin.weight, autocast
    )
    ref = _run(norm, x, norm.weight, autocast)
    assert lean[0].dtype == ref[0].dtype and torch.equal(lean[0], ref[0])  # bit-identical forward
    exact = x_dtype == torch.float32
    for got, want in zip(lean[1:], ref[1:], strict=True):
        assert got.dtype == want.dtype
        scale = want.abs().max().item()
        tol = 1e-5 * scale if exact else 2e-2 * scale  # fp32: rounding only; bf16: its own rounding
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


def _saved_bytes(fn: Any, x: torch.Tensor, weight: torch.Tensor) -> int:
    """Bytes autograd keeps saved for backward by `fn(x, weight)`: storages once, parameters excluded."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, weight).sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("weight_trains", [False, True], ids=["lora", "full"])
def test_saves_the_input_as_it_is_and_one_rstd_per_token(weight_trains: bool) -> None:
    tokens = 2 * 9
    norm = _norm(LlamaRMSNorm, torch.bfloat16).requires_grad_(weight_trains)
    x = torch.randn(2, 9, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    lean = _saved_bytes(lambda x, w: lean_rms_norm(x, w, EPS), x, norm.weight)
    hf = _saved_bytes(lambda x, w: norm(x), x, norm.weight)
    assert lean == tokens * (2 * HIDDEN + 4)  # bf16 input + fp32 rstd
    # HF: the fp32 upcast + rstd, and the bf16 normalized output when the weight trains.
    assert hf == tokens * (4 * HIDDEN + 4 + (2 * HIDDEN if weight_trains else 0))


def test_a_norm_class_it_does_not_know_is_refused() -> None:
    model = torch.nn.ModuleDict({"a": LlamaRMSNorm(HIDDEN), "b": GemmaRMSNorm(HIDDEN)})
    with pytest.raises(ConfigError) as err:
        enable_lean_norm(model)
    message = str(err.value)
    assert "train.lean_norm" in message and "GemmaRMSNorm" in message and "train.lean_norm=false" in message
    assert "forward" not in vars(model["a"])  # nothing replaced when one norm is refused


def test_enable_replaces_only_the_instances_forward() -> None:
    model = torch.nn.Sequential(LlamaRMSNorm(HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN), Qwen3RMSNorm(HIDDEN))
    assert enable_lean_norm(model) == 2
    assert "forward" in vars(model[0]) and "forward" in vars(model[2])
    assert LlamaRMSNorm.forward is not vars(model[0])["forward"]  # the class is untouched
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "1.weight", "1.bias", "2.weight"]


@pytest.mark.parametrize("model_type", sorted(LEAN_NORM_MODEL_TYPES))
def test_the_model_types_auto_may_choose_have_only_known_norms(model_type: str) -> None:
    """`train.lean_norm = auto` is weighed by config.json's model type: each such model, built on the meta
    device, has RMSNorms the lean norm knows (and has some)."""
    from zerofit.catalogue.models import CATALOGUE
    from zerofit.models.meta import build_meta_model

    name = next(n for n, c in CATALOGUE.items() if c.get("model_type") == model_type)
    norms = check_lean_norm(build_meta_model(name, num_layers=1))
    assert len(norms) >= 3  # 2 in the layer + the final norm (Qwen3: + q_norm, k_norm)
