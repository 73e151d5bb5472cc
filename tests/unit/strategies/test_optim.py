"""Optimizer construction and the LR schedule (stepped once per optimizer step)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.strategies.optim import build_optimizer, build_scheduler, lr_multiplier, param_groups


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)  # a frozen (e.g. LoRA base) weight
    return model


def test_param_groups_decay_only_trainable_matrices() -> None:
    model = _model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decay["params"]] == [(4, 4)]
    assert all(p.ndim == 1 and p.requires_grad for p in no_decay["params"])
    assert not any(p is model[2].weight for g in (decay, no_decay) for p in g["params"])


def test_adamw_uses_the_given_lr() -> None:
    cfg = ZerofitConfig.model_validate({"optimizer": {"weight_decay": 0.01}})
    opt = build_optimizer(_model(), cfg, lr=0.5)
    assert isinstance(opt, torch.optim.AdamW)
    assert {g["lr"] for g in opt.param_groups} == {0.5}


def test_no_trainable_parameters_is_a_config_error() -> None:
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(model, ZerofitConfig(), lr=1e-3)


def test_missing_bitsandbytes_is_actionable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import raises ImportError
    cfg = ZerofitConfig.model_validate({"optimizer": {"name": "adamw_8bit"}})
    with pytest.raises(ConfigError, match=r"pip install bitsandbytes.*optimizer.name=adamw"):
        build_optimizer(_model(), cfg, lr=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_paged_adamw_falls_back_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    cfg = ZerofitConfig.model_validate({"optimizer": {"name": "paged_adamw_8bit"}})
    opt = build_optimizer(_model(), cfg, lr=1e-3)
    assert type(opt) is bnb.optim.AdamW8bit
    err = capsys.readouterr().err
    assert "zerofit: warning:" in err and "non-paged" in err


def test_warmup_then_decay_shapes() -> None:
    cosine = lr_multiplier("cosine", warmup_steps=3, max_steps=13, min_lr_ratio=0.1)
    assert [cosine(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cosine(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cosine(13) == pytest.approx(0.1)  # the floor, just after the last step
    linear = lr_multiplier("linear", 0, 10, 0.0)
    assert [linear(s) for s in (0, 5, 9)] == pytest.approx([1.0, 0.5, 0.1])
    constant = lr_multiplier("constant", 2, 10, 0.0)
    assert [constant(s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])


def test_scheduler_follows_the_multiplier_per_step() -> None:
    cfg = ZerofitConfig.model_validate({"scheduler": {"name": "linear", "warmup_steps": 1}})
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=2.0)
    sched = build_scheduler(opt, cfg, max_steps=5)
    factor = lr_multiplier("linear", 1, 5, 0.0)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * factor(s) for s in range(5)])
