"""Throughput fields and MFU: the stated FLOPs formula, and None wherever the device peak is unknown."""

from __future__ import annotations

import types

import pytest
import torch

from zerofit.catalogue.gpus import get_gpu
from zerofit.metrics import throughput
from zerofit.metrics.throughput import mfu, throughput_fields, train_flops_per_token


def test_flops_formula_full_vs_lora() -> None:
    n = 7_000_000_000
    assert train_flops_per_token(n, n) == 6 * n  # full fine-tuning: the familiar 6N
    assert train_flops_per_token(n, 40_000_000) == pytest.approx(4 * n, rel=0.01)  # LoRA: ~4N
    assert train_flops_per_token(0, 0, n_layers=32, hidden=4096, seq_len=2048) == 12 * 32 * 4096 * 2048


def test_mfu_unknown_on_cpu() -> None:
    assert mfu(1e4, 6e9, torch.device("cpu")) is None
    fields = throughput_fields(
        step_time_s=2.0, tokens=1000, samples=8, flops_per_token=6e9, device=torch.device("cpu")
    )
    assert fields == {"step_time_s": 2.0, "tokens_per_s": 500.0, "samples_per_s": 4.0}


def test_mfu_with_a_known_gpu_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda = types.SimpleNamespace(
        is_available=lambda: True, get_device_name=lambda d: "NVIDIA GeForce RTX 3090"
    )
    monkeypatch.setattr(throughput.torch, "cuda", fake_cuda)
    # The planner's GPU catalogue knows the card: 71 TFLOP/s dense bf16.
    assert get_gpu("rtx3090").bf16_tflops == 71.0
    gpu = torch.device("cuda", 0)
    # 2 GPUs at 71 TFLOP/s; 2,500 tokens/s x 2.84e10 FLOPs/token = 71 TFLOP/s = half of the two cards.
    assert mfu(2500.0, 2.84e10, gpu, world_size=2) == pytest.approx(0.5)
    fields = throughput_fields(
        step_time_s=1.0,
        tokens=2000,
        samples=8,
        useful_tokens=2500,
        processed_tokens=4000,
        flops_per_token=2.84e10,
        device=gpu,
        world_size=2,
    )
    assert fields["mfu"] == pytest.approx(0.5)  # useful input tokens (prompts, not padding) feed MFU
    assert fields["tokens_per_s"] == 2000.0
    # Label, useful and processed tokens are three rates: padding costs 4000 / 2500 here.
    assert (fields["useful_tokens_per_s"], fields["processed_tokens_per_s"]) == (2500.0, 4000.0)
