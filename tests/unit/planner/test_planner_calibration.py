"""The planner against measurements: the GPU runs of 2026-12-01 (docs/platform.md) and an independent count
of what a real 7B-width layer saves for backward.

- tensors within 5% of the measured peak allocated (0.2% for bf16 LoRA, +2.1% QLoRA, +2.8% FSDP2);
- predicted total >= measured reserved + CUDA context, and within 5% of it (QLoRA included: the 4-bit
  dequantization blocks are allowed for);
- the speed model within 3% of the measured step times of the LoRA recipe;
- the no-checkpointing activation model within 1% of `_saved_bytes.py` (autograd's own count).

The measured runs used the unchunked loss (the only one then): they are planned with it here.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from zerofit.catalogue.gpus import GPUS
from zerofit.config import load_config
from zerofit.planner.activations.peak import activation_terms
from zerofit.planner.activations.terms import TermKind
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario, what_if
from zerofit.planner.speed import predict_speed

REPO = Path(__file__).resolve().parents[3]
L7 = "meta-llama/Llama-2-7b-hf"
LORA = str(REPO / "configs" / "llama2-7b-lora-3090.yaml")
QLORA = str(REPO / "configs" / "llama2-7b-qlora-3090.yaml")
FSDP = ["distributed.strategy=fsdp", "distributed.preset=fsdp"]
S2048 = ["data.max_seq_len=2048"]
# The CUDA context of a clean process measured 0.51-0.60 GiB; where a run's own reading was spoiled (the
# parent's random model on the GPU), the upper end is used.
CONTEXT_GIB = 0.60

# case: (config, overrides, micro, accum, peak allocated, peak reserved, context or None, tokens/s)
MEASURED: dict[str, tuple[str, list[str], int, int, float, float, float | None, float]] = {
    "lora-m4-s1024": (LORA, [], 4, 8, 15.985, 17.641, None, 7623),
    "lora-m4-s2048": (LORA, S2048, 4, 8, 18.769, 21.059, None, 7815),
    "lora-m8-s1024": (LORA, [], 8, 4, 18.761, 21.059, None, 8317),
    "lora-m2-s2048": (LORA, S2048, 2, 16, 15.990, 17.672, 0.604, 7107),
    "qlora-m4-s2048": (QLORA, [], 4, 8, 12.425, 16.072, 0.514, 5832),
    "fsdp2-1gpu-m4-s1024": (LORA, FSDP, 4, 8, 16.484, 18.307, None, 7487),
}


def _scenario(case: str) -> Scenario:
    path, overrides, micro, accum, *_ = MEASURED[case]
    # Measured (2026-12-01) with sdpa's dense padding mask and the unchunked loss: plan what ran.
    cfg = load_config(
        path,
        [*overrides, "train.cross_entropy=unchunked", "model.attn_implementation=sdpa", "planner.gpu=h200"],
    )
    return what_if(cfg, 1, micro_batch_size=micro, grad_accum_steps=accum)


@pytest.mark.parametrize("case", list(MEASURED))
def test_tensors_and_total_against_the_gpu(case: str) -> None:
    *_, allocated, reserved, context, _ = MEASURED[case]
    est = estimate(_scenario(case))
    assert abs(est.tensors_gib / allocated - 1) < 0.05, est.tensors_gib
    measured_total = reserved + (context if context is not None else CONTEXT_GIB)
    # Never below what the card held (a "fits" must not OOM), never more than 5% above it.
    assert measured_total <= est.total_gib <= 1.05 * measured_total, (est.total_gib, measured_total)


@pytest.mark.parametrize("case", [c for c in MEASURED if c.startswith("lora")])
def test_speed_model_against_the_measured_step_times(case: str) -> None:
    measured = MEASURED[case][-1]
    predicted = predict_speed(_scenario(case), GPUS["h200"]).tokens_per_s
    assert abs(predicted / measured - 1) < 0.03, predicted


def _selective(n: int) -> Any:
    return estimate(Scenario(model=L7, seq_len=1024, micro_batch_size=4, activation_checkpointing=n))


def test_selective_checkpointing_trades_memory_for_recompute_layer_by_layer() -> None:
    """Memory falls with every checkpointed layer (0 -> 32), predicted speed falls with it."""
    peaks = [_selective(n).tensors_gib for n in range(0, 33, 4)]
    assert all(a > b for a, b in itertools.pairwise(peaks))
    speeds = [
        predict_speed(
            Scenario(model=L7, seq_len=1024, micro_batch_size=4, activation_checkpointing=n)
        ).tokens_per_s
        for n in (0, 16, 32)
    ]
    assert speeds[0] > speeds[1] > speeds[2]
    # Full recomputation costs one more forward of the decoder layers: ~30% of a LoRA step's FLOPs.
    assert 1.25 < speeds[0] / speeds[2] < 1.5


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_no_checkpointing_layer_model_against_autograds_count_of_a_real_7b_layer(dropout: float) -> None:
    from _saved_bytes import saved_bytes_per_layer

    seq = 64
    measured = saved_bytes_per_layer(seq, dropout)
    # The layer as measured: bf16 base, fp32 LoRA adapters, no autocast, one unpadded sequence.
    scn = Scenario(model=L7, seq_len=seq, micro_batch_size=1, lora_dropout=dropout, autocast=False)
    terms = activation_terms(scn).per_layer_token_terms
    # The planner counts CUDA's one-byte dropout mask; the CPU keeps one fp32 per element.
    cpu_masks = 3 * sum(t.bytes for t in terms if t.kind is TermKind.LORA_DROPOUT_MASKS)
    predicted = (sum(t.bytes for t in terms) + cpu_masks) * seq
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)
