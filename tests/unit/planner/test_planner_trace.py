"""The analytic model against the FakeTensor + MemTracker trace of the configured step: within 5%.

The matrix covers seq 128-2048, micro-batch 1-8, LoRA and full fine-tuning, checkpointing on and off, the
tiny model (where activations and their transients dominate) and the Llama-2-7B shape (where weights do),
on the two compute profiles zerofit's engines use: `single` (autocast over fp32 adapters / fp32 weights)
and DeepSpeed (every parameter cast to bf16). Each point traces 1 and 2 layers on CPU in about a second.
"""

from __future__ import annotations

import pytest

from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario
from zerofit.planner.trace import trace_memory

L7 = "meta-llama/Llama-2-7b-hf"
TINY = "tiny-llama"

MATRIX = [
    # model, strategy, lora, seq, micro, checkpointing
    (TINY, "single", True, 128, 1, False),
    (TINY, "single", True, 512, 4, True),
    (TINY, "single", False, 256, 8, True),
    (TINY, "deepspeed", True, 2048, 2, False),
    (TINY, "deepspeed", False, 1024, 1, True),
    (L7, "single", True, 2048, 1, False),
    (L7, "deepspeed", True, 512, 4, True),
    (L7, "single", False, 128, 8, True),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "strategy", "lora", "seq", "micro", "ckpt"), MATRIX)
def test_analytic_within_5_percent_of_trace(
    model: str, strategy: str, lora: bool, seq: int, micro: int, ckpt: bool
) -> None:
    scn = Scenario(
        model=model,
        seq_len=seq,
        micro_batch_size=micro,
        strategy=strategy,
        lora=lora,
        activation_checkpointing=ckpt,
        lora_dropout=0.05 if micro == 4 else 0.0,
    )
    traced = trace_memory(scn)
    predicted = estimate(scn).tensors_gib
    assert abs(predicted / traced.tensors_gib - 1) < 0.05, (predicted, traced.as_dict())


def test_trace_extrapolates_layers_and_adds_untraceable_state() -> None:
    # ZeRO-3 over 2 ranks with an 8-bit optimizer: partitions and bitsandbytes state are added analytically.
    scn = Scenario(
        model=L7, seq_len=256, micro_batch_size=2, strategy="deepspeed", zero_stage=3, dp_size=2,
        optimizer="adamw_8bit", activation_checkpointing=True,
    )  # fmt: skip
    traced = trace_memory(scn)
    one, two = traced.layers
    assert two.peak_bytes > one.peak_bytes  # one more decoder layer, more memory
    assert traced.engine_added_gib != 0  # the partitions and the 8-bit state the trace cannot run
    assert abs(estimate(scn).tensors_gib / traced.tensors_gib - 1) < 0.05


def test_fsdp_with_a_4bit_base_swaps_every_traced_weight_for_its_shard() -> None:
    # QLoRA on FSDP2: the trace holds the 4-bit weights as bf16 stand-ins, unsharded; all of them give way to
    # the analytic shards (a sign slip here once left the trace 4.5x the analytic figure).
    scn = Scenario(
        model=L7, seq_len=256, micro_batch_size=1, strategy="fsdp", dp_size=2, quantization="4bit",
        activation_checkpointing=True,
    )  # fmt: skip
    assert abs(estimate(scn).tensors_gib / trace_memory(scn).tensors_gib - 1) < 0.05
