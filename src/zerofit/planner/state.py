"""Resident model state per rank: weights, gradients, optimizer state, master copies and engine buffers.

Counted in bytes from the model's exact shapes (`shapes.py`) and what each engine keeps: the dtype rule
(`zerofit.precision`), bitsandbytes quantization, ZeRO partitions and CPU offload, FSDP2 shards, and the
optimizer's state and step temporaries. Lines are named so a breakdown adds up by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerofit.planner.scenario import ComputeProfile, Scenario, compute_profile
from zerofit.planner.shapes import ModelShape, lora_shape, model_shape
from zerofit.precision import dtype_bytes

# torch AdamW keeps `step` as a host tensor (foreach/for-loop default): no device bytes.
# bitsandbytes' 8-bit optimizers keep 8-bit state only for tensors of at least this many elements.
BNB_MIN_8BIT_SIZE = 4096
BNB_OPT_BLOCK = 256
# DeepSpeed ZeRO-3 keeps up to this many gathered parameter elements live (stage3_max_live_parameters).
ZERO3_MAX_LIVE_PARAMETERS = 10**9


@dataclass(frozen=True)
class ParamCounts:
    """The model's parameters split by how the engine stores them."""

    quantized: int  # decoder-layer linear weights under 4/8-bit
    frozen: int  # frozen, not quantized (the LoRA base or the non-quantized rest under QLoRA)
    trainable: int  # LoRA adapters or every parameter (full fine-tuning)
    trainable_numels: tuple[int, ...]  # per tensor (bitsandbytes' per-tensor 8-bit rule)
    quantized_linears: tuple[tuple[int, int], ...]  # (out, in) of each quantized weight, one layer's worth
    layers: int


def param_counts(scn: Scenario) -> ParamCounts:
    """Exact parameter counts by storage class for `scn`'s model and adaptation."""
    shape = model_shape(scn.model)
    quantized_per_layer = shape.layer_linear_weight_params if scn.quantization != "none" else 0
    quantized = quantized_per_layer * shape.num_layers
    if scn.lora:
        lora = lora_shape(scn.model, scn.lora_r, scn.lora_targets, scn.use_dora)
        trainable, numels = lora.trainable_params, lora.tensor_numels
        frozen = shape.total_params - quantized
    else:
        trainable, numels, frozen = shape.total_params, shape.param_numels, 0
    linears = tuple((lin.out_features, lin.in_features) for lin in shape.linears) if quantized else ()
    return ParamCounts(quantized, frozen, trainable, numels, linears, shape.num_layers)


def quantized_weight_bytes(out_features: int, in_features: int, scn: Scenario) -> int:
    """Device bytes of one bitsandbytes-quantized weight, statistics included.

    4-bit (nf4/fp4): two values per byte + one absmax per 64-value block (fp32; with double quantization
    an 8-bit absmax plus one fp32 second-level absmax per 256 blocks). 8-bit (LLM.int8): one byte per value
    + one fp32 scale per output row.
    """
    n = out_features * in_features
    if scn.quantization == "8bit":
        return n + 4 * out_features
    blocks = math.ceil(n / 64)
    stats = blocks + 4 * math.ceil(blocks / 256) if scn.double_quant else 4 * blocks
    return math.ceil(n / 2) + stats


def optimizer_state_bytes(scn: Scenario, numels: tuple[int, ...]) -> int:
    """Optimizer state for trainable tensors of these sizes (unsharded).

    AdamW: fp32 exp_avg + exp_avg_sq = 8 B/param. bitsandbytes AdamW8bit / PagedAdamW8bit: two uint8
    states + one fp32 absmax per 256-value block each, for tensors of >= 4096 elements (smaller ones keep
    32-bit state). Lion8bit: one state.
    """
    if scn.optimizer == "adamw":
        return 8 * sum(numels)
    states = 1 if scn.optimizer == "lion_8bit" else 2
    total = 0
    for n in numels:
        if n >= BNB_MIN_8BIT_SIZE:
            total += states * (n + 4 * math.ceil(n / BNB_OPT_BLOCK))
        else:
            total += states * 4 * n
    return total + states * 256 * 4  # the shared quantization maps


@dataclass
class StateTerms:
    """Resident model state on the GPU (per rank) and on the host, in bytes, by named line."""

    gpu: dict[str, int] = field(default_factory=dict)  # always resident
    window_grads: dict[str, int] = field(default_factory=dict)  # held between micro-steps of a window
    step_temps: dict[str, int] = field(default_factory=dict)  # only during the optimizer step
    in_layer: dict[str, int] = field(default_factory=dict)  # only while a decoder layer runs (FSDP2 gathers)
    host: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # For the trace: lines it measures itself (plain weights, autograd gradients, torch AdamW), and bytes
    # of unsharded compute-dtype weights it holds that the engine does not (ZeRO-3 / FSDP shard them).
    traced: set[str] = field(default_factory=set)
    trace_weight_surplus: int = 0

    def put_traced(self, lines: dict[str, int], label: str, nbytes: int) -> None:
        """Add a line of `lines` that the FakeTensor trace measures itself: the label is written once, as
        the line's key, so what is traced never depends on restating a display string."""
        lines[label] = nbytes
        self.traced.add(label)


def model_state(scn: Scenario) -> StateTerms:
    """Weights, gradients, optimizer state, master copies and engine buffers, per rank (bytes)."""
    prof = compute_profile(scn)
    shape = model_shape(scn.model)
    counts = param_counts(scn)
    dp = max(scn.dp_size, 1)
    t = StateTerms()
    T = counts.trainable
    half_b = dtype_bytes(prof.half) if prof.half else 4
    quant_b = sum(quantized_weight_bytes(o, i, scn) for o, i in counts.quantized_linears) * counts.layers
    # Frozen non-quantized weights: loaded in the load dtype, upcast to fp32 by k-bit preparation.
    frozen_b = 4 if scn.quantization != "none" else dtype_bytes(prof.load)
    train_b = 4  # LoRA adapters stay fp32 (peft), full fine-tuning loads fp32
    opt_state = optimizer_state_bytes(scn, counts.trainable_numels)
    # from_pretrained reads the checkpoint into host memory in the load dtype before the engine moves it.
    base_params = shape.total_params
    t.host[f"model load ({prof.load}, transient, x {dp} rank(s) on a node)"] = (
        base_params * dtype_bytes(prof.load) * dp
    )
    qlabel = f"{scn.quantization} base weights (bitsandbytes, incl. absmax)"
    frozen_label = "frozen base weights" if scn.lora else "weights"
    if quant_b:
        frozen_label = "non-quantized base weights (embeddings, norms, lm_head; k-bit prepared)"

    if scn.strategy in ("single", "ddp"):
        if quant_b:
            t.put_traced(t.gpu, qlabel, quant_b)  # traced as half stand-ins; the trace swaps the bytes
        if counts.frozen:
            t.put_traced(
                t.gpu, f"{frozen_label} ({dtype_label(frozen_b, prof.half)})", counts.frozen * frozen_b
            )
        t.put_traced(t.gpu, f"trainable weights (fp32, {T:,} params)", T * train_b)
        opt_label = f"optimizer state ({scn.optimizer})"
        t.gpu[opt_label] = opt_state
        t.put_traced(t.window_grads, "gradients (fp32)", T * 4)
        if scn.strategy == "ddp":
            # DDP's bucket buffers are a second copy of the gradients (gradient_as_bucket_view=False).
            t.gpu["DDP gradient buckets (fp32)"] = T * 4
        if scn.optimizer == "adamw":
            # foreach AdamW: one fp32 temporary the size of all parameters (sqrt of exp_avg_sq).
            t.put_traced(t.step_temps, "AdamW foreach temporaries (fp32)", T * 4)
            t.traced.add(opt_label)  # torch's AdamW runs in the trace: its state is measured there
        return t

    if scn.strategy == "deepspeed":
        return _deepspeed_state(scn, prof, t, counts, quant_b, qlabel, frozen_label, half_b, opt_state)
    return _fsdp_state(scn, prof, t, counts, shape, quant_b, qlabel, frozen_b, half_b, opt_state, dp)


def dtype_label(nbytes: int, half: str | None = "bf16") -> str:
    """A short dtype name for a breakdown line, from an element size (2 bytes: the run's half dtype)."""
    return {4: "fp32", 2: half or "bf16", 1: "int8"}.get(nbytes, f"{nbytes} B")


def _deepspeed_state(
    scn: Scenario,
    prof: ComputeProfile,
    t: StateTerms,
    counts: ParamCounts,
    quant_b: int,
    qlabel: str,
    frozen_label: str,
    half_b: int,
    opt_state: int,
) -> StateTerms:
    dp = max(scn.dp_size, 1)
    stage = scn.zero_stage
    T = counts.trainable
    # DeepSpeed casts every floating parameter to the half dtype (fp32 training: stays fp32).
    pb = half_b
    mixed = prof.half is not None
    shard_params = stage == 3
    if quant_b:
        t.put_traced(t.gpu, qlabel, quant_b)
    weights = (counts.frozen + T) * pb
    if shard_params:
        t.trace_weight_surplus = weights
        live = min(counts.frozen + T, ZERO3_MAX_LIVE_PARAMETERS) * pb
        if scn.offload_params:
            t.host[f"ZeRO-3 offloaded parameters ({dtype_label(pb, prof.half)})"] = weights
            t.notes.append("parameters live on the host; the GPU holds only gathered layers")
        else:
            t.gpu[f"ZeRO-3 parameter partition ({dtype_label(pb, prof.half)}, 1/{dp})"] = weights // dp
        t.gpu["ZeRO-3 gathered parameters (up to stage3_max_live_parameters)"] = live
    else:
        t.put_traced(t.gpu, f"{frozen_label} + trainable weights ({dtype_label(pb, prof.half)})", weights)
    shard = dp if stage >= 1 else 1
    master = T * 4 // shard if mixed else 0
    opt = opt_state // shard
    where = t.host if scn.offload_optimizer else t.gpu
    suffix = f", 1/{shard}" if shard > 1 else ""
    if master:
        where[f"fp32 master weights (DeepSpeed{suffix})"] = master
    where[
        f"optimizer state ({'DeepSpeed CPU Adam' if scn.ds_builds_optimizer else scn.optimizer}{suffix})"
    ] = opt
    # Gradients: ZeRO-0/1 accumulate full gradients in the parameter dtype; ZeRO-2/3 reduce each into a
    # partition buffer (plus one reduce bucket) every micro-step.
    bucket = min(T, model_shape(scn.model).hidden_size ** 2) * pb
    if stage <= 1:
        t.put_traced(t.window_grads, f"gradients ({dtype_label(pb, prof.half)})", T * pb)  # autograd's .grad
    else:
        t.gpu["ZeRO reduce bucket"] = bucket
        if scn.offload_optimizer:
            t.host[f"gradient partition (fp32{suffix})"] = T * 4 // shard
        else:
            t.gpu[f"gradient partition ({dtype_label(pb, prof.half)}{suffix})"] = T * pb // shard
    if mixed and not scn.offload_optimizer:
        # At the step the optimizer reads an fp32 copy of this rank's gradient partition.
        t.step_temps[f"fp32 gradient partition at step{suffix}"] = T * 4 // shard
    return t


def _fsdp_state(
    scn: Scenario,
    prof: ComputeProfile,
    t: StateTerms,
    counts: ParamCounts,
    shape: ModelShape,
    quant_b: int,
    qlabel: str,
    frozen_b: int,
    half_b: int,
    opt_state: int,
    dp: int,
) -> StateTerms:
    T = counts.trainable
    t.trace_weight_surplus = (counts.frozen + T) * half_b
    if quant_b:
        t.trace_weight_surplus += quant_b - counts.quantized * half_b
    where = t.host if scn.fsdp_cpu_offload else t.gpu
    sharded = (quant_b + counts.frozen * frozen_b + T * 4) // dp
    where[f"sharded weights (original dtypes, 1/{dp})"] = sharded
    # Unsharded in param_dtype: the root group (embeddings, final norm, lm_head) stays gathered through the
    # step; decoder layers are gathered one at a time plus the next one prefetched, only while layers run
    # (the loss and the optimizer step see the root alone: measured on one GPU, docs/platform.md).
    layer_numel = shape.layer_params + (counts.trainable // shape.num_layers if scn.lora else 0)
    root_numel = shape.total_params - shape.num_layers * shape.layer_params
    half = dtype_label(half_b, prof.half)
    t.gpu[f"gathered weights: root (embeddings, final norm, lm_head; {half})"] = root_numel * half_b
    t.in_layer[f"gathered weights: 2 decoder layers (running + prefetched; {half})"] = (
        2 * layer_numel * half_b
    )
    t.gpu[f"sharded gradients (fp32, 1/{dp})"] = T * 4 // dp if not scn.fsdp_cpu_offload else 0
    if scn.fsdp_cpu_offload:
        t.host[f"sharded gradients (fp32, 1/{dp})"] = T * 4 // dp
    where[f"optimizer state ({scn.optimizer}, 1/{dp})"] = opt_state // dp
    if scn.grad_accum_steps > 1 and not scn.fsdp_cpu_offload:
        # set_requires_gradient_sync(False): unsharded gradients accumulate in reduce_dtype (fp32).
        t.window_grads["unsharded accumulated gradients (fp32, no-sync window)"] = T * 4
    if scn.optimizer == "adamw":
        t.step_temps["AdamW foreach temporaries (fp32, sharded)"] = T * 4 // dp
    return t
