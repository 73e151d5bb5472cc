"""How fast a plan runs: the cost model the planner maximizes when it picks (micro-batch, checkpointed layers).

One micro-step of a rank costs a fixed overhead plus its FLOPs at a sustained rate:

    t_micro = overhead + tokens x flops_per_token(n) / rate
    overhead = MICRO_STEP_OVERHEAD_S_PER_LAYER x decoder layers     (kernel launches, LoRA's small ops,
                                                                     ZeRO's per-micro-step reduce)
    rate     = SUSTAINED_FRACTION x the GPU's dense bf16 peak        (/ FP32_SLOWDOWN in fp32)
    flops_per_token(n) = forward 2 N + 4 L h s
                       + backward 2 N (activation gradients) + 2 N_trainable + 8 L h s
                       + recompute (n / L) x (2 N_layers + 4 L h s)   for n of L layers checkpointed

with N the matmul weights (decoder layers + lm_head; of a mixture of experts only the k experts a token is
routed to, and the router), N_layers those of the decoder layers, h the attention width (heads x head_dim),
s the sequence length (attention: PaLM's 12 L h s per token, forward 4, backward 8), N_trainable the
adapters on linears (LoRA; every weight in full fine-tuning). Adapted 3-D expert weights of a mixture of
experts (`lora.moe_experts: all`) cost what peft computes for them instead (`expert_adapter_flops`: the
merged weight's gradient over the routed tokens and the per-micro-step fold). A step is
`grad_accum_steps` micro-steps; tokens/s is the global batch's tokens over the step time. A 4-bit base
dequantizes every weight on the fly: KBIT_SLOWDOWN on the compute term.

So a bigger micro-batch amortizes the overhead, and every checkpointed layer adds its forward again: the
planner trades one against the other under the memory budget.

The long-context levers add their own costs:
  - tiled MLP (train.tiled_mlp > 1): one more MLP forward per layer, 2 N_mlp per token (the backward
    recomputes each shard's intermediates);
  - fused_linear loss: one more lm_head matmul, 2 h V per token (the gradients are recomputed per chunk);
  - lean RMSNorm (train.lean_norm): each norm recomputes its fp32 normalized value in backward, an
    elementwise pass that moves ~10 bytes per element (read the input, write and read the fp32 value):
    memory-bound, charged as LEAN_NORM_FLOPS_PER_ELEMENT matmul FLOPs per element (a GPU's sustained
    matmul rate is ~30x its HBM bandwidth in bytes/s), (2 L + 1) norms x h elements per token: ~0.2% of a
    step at the 8B shape;
  - activation offload: every checkpointed layer input crosses PCIe down in forward and up in backward,
    2 x n x tokens x h x residual bytes per micro-step at the GPU's `pcie_gbps`, on a side stream that
    overlaps compute: it costs max(0, transfer - compute) per micro-step.

Ulysses sequence parallelism (`distributed.sequence_parallel: N`): a rank computes its 1/N
shard of every sequence (attention over the whole sequence for 1/N of the heads: the same FLOPs per token),
and per decoder layer 4 all-to-alls (q, k, v, the attention output) run in forward, 4 in backward and 4
more in a checkpointed layer's recomputation, each moving (N - 1) / N of the shard's tensor at the GPU's
`interconnect_gbps` (NVLink, else PCIe). They sit on the attention's critical path, so they are added, not
overlapped. Stated from the vendors' bandwidths, not measured (no 2-GPU run yet).

Preference tuning: a micro-batch of m pairs is a forward and backward of 2m sequences, so
tokens count both sequences of every pair (tokens/s included); DPO's reference with the adapters off adds a
no-grad forward of the base, 2 N + 4 L h s per token; a precomputed reference costs nothing per step (its
one pass before training is not in the step time).

The opt-in speed levers multiply the sustained rate by stated factors, never fitted from
anything but measured runs: KERNEL_SPEED_FACTOR (train.kernels) and COMPILE_SPEED_FACTOR (train.compile)
are 1.0 (no gain claimed) until a GPU run of this code measures them; the claims elsewhere (Liger's README
~20% throughput, torchtune #1228 ~30% faster QLoRA with compile) are not this code's measurements. The
planner never turns either lever on (they are not `auto` keys), so they never change which plan is chosen;
`zerofit plan` prints the factors it assumed (`speed_levers`).

Calibration (docs/platform.md, GPU measurements 2026-12-01: Llama-2-7B LoRA r16, ZeRO-2, bf16, full
checkpointing, H200 capped at 24 GiB): micro 4 -> 8 at 1024 tokens and micro 2 -> 4 at 2048 tokens give
the same per-token slope (1.09e-4 and 1.15e-4 s/token for 41.6 and 43.8 GFLOP/token: 380 TFLOP/s, 38.5% of
the H200's 989) and the same fixed part (0.090 and 0.104 s per micro-step, ~3 ms per layer). The model
then reproduces the four measured step times within 2%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerofit.catalogue.gpus import GPUS
from zerofit.core.precision import dtype_bytes
from zerofit.planner.activations.dtypes import residual_bytes
from zerofit.planner.shapes import model_shape

if TYPE_CHECKING:
    from zerofit.catalogue.gpus import GPU
    from zerofit.planner.scenario import Scenario

SUSTAINED_FRACTION = 0.385
MICRO_STEP_OVERHEAD_S_PER_LAYER = 0.003
FP32_SLOWDOWN = 4.0  # fp32 matmuls (TF32 at best) against the bf16 tensor peak
# QLoRA (4-bit, single) ran at 5,832 tokens/s where bf16 LoRA (ZeRO-2) ran at 7,815 (4 x 2048, same card).
KBIT_SLOWDOWN = 1.34
# ~10 bytes moved per element at ~30 sustained matmul FLOPs per byte of HBM bandwidth (module docstring).
LEAN_NORM_FLOPS_PER_ELEMENT = 300.0
# Rate multipliers of the opt-in speed levers: 1.0 = no gain claimed (not measured on this code yet).
KERNEL_SPEED_FACTOR = {"none": 1.0, "liger": 1.0}
COMPILE_SPEED_FACTOR = 1.0
REFERENCE_GPU = "rtx3090"  # whose rates are used when the budget names no GPU (speeds are then relative)


@dataclass(frozen=True)
class SpeedEstimate:
    """Predicted time of one optimizer step and the throughput it gives (all ranks together)."""

    step_time_s: float
    tokens_per_s: float
    flops_per_token: float  # including recomputation
    recompute_fraction: float  # share of flops_per_token that recomputes checkpointed layers
    gpu: str  # whose rates were used
    reference: bool  # True: the GPU was not named, only ratios between plans mean something


def flops_per_token(scn: Scenario) -> tuple[float, float]:
    """(FLOPs per trained token including recomputation, the recomputation's part), per the module formula."""
    shape = model_shape(scn.model)
    n_layers, h, s = shape.num_layers, shape.hidden_size, scn.seq_len
    # A mixture of experts: a token runs through its k routed experts only (all are resident).
    layer_matmul = float(shape.layer_active_matmul_params * n_layers)
    matmul = layer_matmul + shape.vocab_size * h
    ckpt = scn.checkpointed(n_layers)
    trainable, experts = matmul, 0.0
    if scn.lora:
        lora = scn.lora_shape()
        trainable = float(lora.trainable_params - lora.layer_expert_factor_params * n_layers)
        experts = expert_adapter_flops(scn, lora.merged_expert_numel, ckpt)
    attention = 4.0 * n_layers * shape.q_dim * s  # q_dim: head_dim x heads (Gemma: > h)
    forward = 2 * matmul + attention
    backward = 2 * matmul + 2 * trainable + 2 * attention + experts
    recompute = ckpt / n_layers * (2 * layer_matmul + attention)
    levers = 0.0
    if scn.tiled_mlp > 1:
        levers += 2.0 * shape.layer_mlp_weight_params * n_layers
    if scn.cross_entropy == "fused_linear":
        levers += 2.0 * h * shape.vocab_size
    if scn.lean_norm:
        levers += LEAN_NORM_FLOPS_PER_ELEMENT * (2 * n_layers + 1) * h
    reference = forward * scn.no_grad_forwards  # DPO's reference, KTO's reference and KL pass: no grad
    return forward + backward + recompute + levers + reference, recompute


def expert_adapter_flops(scn: Scenario, merged_numel: int, checkpointed: int) -> float:
    """Per trained token, what peft 0.21's `ParamWrapper` computes for LoRA on a mixture of experts' 3-D
    expert weights (`lora.moe_experts: all`), beyond the base model's FLOPs (counted with torch's
    FlopCounterMode: tests/unit/planner/test_planner_families.py).

    The adapted weight is parametrized as W' = W + s lhs @ rhs for every expert of the layer, one
    `baddbmm` of 2 r P FLOPs for the layer's P adapted expert elements, and it runs twice per forward:
    torch's `register_parametrization`, which peft calls in each forward, evaluates it once to check it,
    then the forward's cached use (again both in a checkpointed layer's recomputation). W' requires grad,
    so the routed experts' matmuls compute its full weight gradient, 2 k/E P per token (what a full
    fine-tune of the experts computes), and the fold's backward turns it into the two factors' gradients
    (4 r P). The folds are per micro-step, spread over the micro-step's tokens."""
    if not merged_numel:
        return 0.0
    shape = model_shape(scn.model)
    layers = shape.num_layers
    routed = 2.0 * shape.experts_per_token / shape.num_experts * merged_numel * layers
    fold = 2.0 * scn.lora_r * merged_numel * (4 * layers + 2 * checkpointed)
    return routed + fold / (scn.rows * scn.seq_len)


def offload_transfer_s(scn: Scenario, card: GPU) -> float:
    """Seconds one micro-step's offload copies take at `card`'s PCIe bandwidth (down and back up)."""
    if not scn.activation_offload:
        return 0.0
    shape = model_shape(scn.model)
    per_layer = scn.rows * scn.shard_seq_len * shape.hidden_size * residual_bytes(scn)
    return 2.0 * scn.checkpointed(shape.num_layers) * per_layer / (card.pcie_gbps * 1e9)


def ulysses_transfer_s(scn: Scenario, card: GPU) -> float:
    """Seconds one micro-step's Ulysses all-to-alls take at `card`'s interconnect (0 without them)."""
    sp = scn.sequence_parallel
    if sp <= 1:
        return 0.0
    shape = model_shape(scn.model)
    compute_bytes = dtype_bytes(scn.precision)
    # q and the output are num_heads wide, k and v num_kv_heads; a rank keeps 1/N of what it holds.
    width = (2 * shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_layer = scn.rows * scn.shard_seq_len * width * compute_bytes * (sp - 1) / sp
    passes = 2.0 * shape.num_layers + scn.checkpointed(shape.num_layers)  # forward, backward, recompute
    return passes * per_layer / (card.interconnect_gbps * 1e9)


def predict_speed(scn: Scenario, gpu: GPU | None = None) -> SpeedEstimate:
    """The cost model for `scn` on `gpu` (the reference GPU's rates when None)."""
    card = gpu if gpu is not None else GPUS[REFERENCE_GPU]
    rate = SUSTAINED_FRACTION * card.bf16_tflops * 1e12
    if scn.precision == "fp32":
        rate /= FP32_SLOWDOWN
    if scn.quantization == "4bit":
        rate /= KBIT_SLOWDOWN
    rate *= KERNEL_SPEED_FACTOR[scn.kernels] * (COMPILE_SPEED_FACTOR if scn.compile else 1.0)
    total, recompute = flops_per_token(scn)
    n_layers = model_shape(scn.model).num_layers
    micro_tokens = scn.rows * scn.seq_len  # both sequences of every pair under a preference objective
    compute = scn.rows * scn.shard_seq_len * total / rate  # a rank's shard (all of it without Ulysses)
    # Offload copies run on a side stream: only what compute does not hide costs time.
    hidden_copy = max(0.0, offload_transfer_s(scn, card) - compute)
    t_micro = (
        MICRO_STEP_OVERHEAD_S_PER_LAYER * n_layers + compute + hidden_copy + ulysses_transfer_s(scn, card)
    )
    step = scn.grad_accum_steps * t_micro
    global_tokens = micro_tokens * scn.grad_accum_steps * scn.dp_size
    return SpeedEstimate(
        step_time_s=step,
        tokens_per_s=global_tokens / step,
        flops_per_token=total,
        recompute_fraction=recompute / total,
        gpu=card.name,
        reference=gpu is None,
    )


def speed_levers(scn: Scenario) -> str | None:
    """What the speed model assumed for the opt-in speed levers this run turns on (None: neither is on)."""
    parts = []
    if scn.kernels != "none":
        parts.append(f"kernels {scn.kernels} x{KERNEL_SPEED_FACTOR[scn.kernels]:.2f}")
    if scn.compile:
        parts.append(f"compile x{COMPILE_SPEED_FACTOR:.2f}")
    if not parts:
        return None
    return (
        ", ".join(parts) + " on the sustained rate (1.00: not measured on this code, no gain claimed; opt-in)"
    )
