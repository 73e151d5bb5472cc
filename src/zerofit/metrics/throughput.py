"""Throughput per optimizer step: tokens/s, samples/s, step time and model FLOPs utilization (MFU).

FLOPs per trained token (stated, because every framework counts differently):

    forward                       2 * N_total            (each weight used once in a multiply-add)
    backward, activation grads    2 * N_total            (needed through every layer above the lowest
                                                          trainable one; with LoRA that is ~all of them)
    backward, weight grads        2 * N_trainable        (only parameters that get a gradient)
    attention scores and values   12 * n_layers * hidden * seq_len   (fwd 4, bwd 8; PaLM appendix B)

so full fine-tuning gives the familiar 6N (+ attention) and LoRA about 4N. N counts the matmul weights
(embedding lookups are not multiplies, but a tied or untied LM head is). Recomputation under activation
checkpointing is *not* counted: that is MFU, not hardware FLOPs utilization. MFU uses every token the
model computed on usefully (prompts included, padding not), not only the valid label tokens of the loss.

Three token rates per step: `tokens_per_s` (valid label tokens: what the loss learns from),
`useful_tokens_per_s` (input tokens that are not padding) and `processed_tokens_per_s` (every position of
every micro-batch, padding included): their ratio is what padding costs, and what packing saves.
"""

from __future__ import annotations

import torch

from zerofit.catalogue.gpus import gpu_peak_tflops


def train_flops_per_token(
    n_total: int, n_trainable: int, *, n_layers: int = 0, hidden: int = 0, seq_len: int = 0
) -> float:
    """Model FLOPs to train on one token (see the module docstring for the formula)."""
    return 4.0 * n_total + 2.0 * n_trainable + 12.0 * n_layers * hidden * seq_len


def device_peak_tflops(device: torch.device, precision: str = "bf16") -> float | None:
    """Dense peak TFLOP/s of `device` for `precision`, or None where unknown (CPU, unlisted GPU, fp32)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return float(gpu_peak_tflops(torch.cuda.get_device_name(device), precision))
    except KeyError:  # a GPU or precision the planner's catalogue has no peak for
        return None


def mfu(
    tokens_per_s: float,
    flops_per_token: float,
    device: torch.device,
    *,
    world_size: int = 1,
    precision: str = "bf16",
) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved model FLOP/s over `world_size` devices' peak.

    `tokens_per_s` is the throughput of all ranks together (processed tokens). None when the device's
    peak is unknown (CPU, or a GPU missing from the planner's catalogue).
    """
    peak = device_peak_tflops(device, precision)
    if peak is None or world_size < 1 or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak * 1e12 * world_size)


def throughput_fields(
    *,
    step_time_s: float,
    tokens: float,
    samples: float,
    useful_tokens: float | None = None,
    processed_tokens: float | None = None,
    flops_per_token: float | None = None,
    device: torch.device | None = None,
    world_size: int = 1,
    precision: str = "bf16",
) -> dict[str, float]:
    """`tokens_per_s` (valid label tokens), `samples_per_s`, `step_time_s`, `useful_tokens_per_s` and
    `processed_tokens_per_s` where their counts are given, and `mfu` where known.

    All counts are for the whole global batch (every rank). `useful_tokens` (input tokens, prompts included,
    padding not) feeds MFU; it defaults to `tokens`.
    """
    rate = (lambda n: n / step_time_s) if step_time_s > 0 else (lambda n: 0.0)
    out = {
        "step_time_s": step_time_s,
        "tokens_per_s": rate(tokens),
        "samples_per_s": rate(samples),
    }
    if useful_tokens is not None:
        out["useful_tokens_per_s"] = rate(useful_tokens)
    if processed_tokens is not None:
        out["processed_tokens_per_s"] = rate(processed_tokens)
    if flops_per_token is not None and device is not None and step_time_s > 0:
        processed = tokens if useful_tokens is None else useful_tokens
        value = mfu(
            processed / step_time_s, flops_per_token, device, world_size=world_size, precision=precision
        )
        if value is not None:
            out["mfu"] = value
    return out
