"""Resident model state per rank: weights, gradients, optimizer state, master copies and engine buffers.

Counted in bytes from the model's exact shapes (`shapes.py`) and what each engine keeps: the dtype rule
(`zerofit.core.precision`), bitsandbytes quantization, ZeRO partitions and CPU offload, FSDP2 shards, and the
optimizer's state and step temporaries. Each line is typed (`StateLine`: a `StateKind`, the `Place` it
is held at, bytes and a display label), so code selects lines by kind and place, never by label; the labels
make a breakdown that adds up by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from zerofit.core.precision import dtype_bytes
from zerofit.planner.scenario import ComputeProfile, Scenario, compute_profile
from zerofit.planner.shapes import ModelShape, model_shape

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
        lora = scn.lora_shape()
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


class StateKind(StrEnum):
    """What a resident-state line models (its label is only for display)."""

    QUANTIZED_WEIGHTS = "quantized base weights"  # bitsandbytes 4/8-bit, statistics included
    FROZEN_WEIGHTS = "frozen weights"  # the LoRA base (non-quantized part under QLoRA)
    TRAINABLE_WEIGHTS = "trainable weights"  # LoRA adapters, or every weight in full fine-tuning
    WEIGHTS = "weights"  # DeepSpeed ZeRO-0/1/2: frozen + trainable, cast to one dtype
    PARAMETER_PARTITION = "ZeRO-3 parameter partition"
    OFFLOADED_PARAMETERS = "ZeRO-3 offloaded parameters"
    GATHERED_PARAMETERS = "ZeRO-3 gathered parameters"
    SHARDED_WEIGHTS = "FSDP2 sharded weights"
    GATHERED_ROOT = "FSDP2 gathered root"
    GATHERED_LAYERS = "FSDP2 gathered decoder layers"
    MASTER_WEIGHTS = "fp32 master weights"
    OPTIMIZER_STATE = "optimizer state"
    GRADIENTS = "gradients"  # autograd's .grad, accumulated across a window
    DDP_BUCKETS = "DDP gradient buckets"
    REDUCE_BUCKET = "ZeRO reduce bucket"
    GRADIENT_PARTITION = "gradient partition"
    SHARDED_GRADIENTS = "FSDP2 sharded gradients"
    ACCUMULATED_GRADIENTS = "FSDP2 unsharded accumulated gradients"
    OPTIMIZER_TEMPORARIES = "optimizer step temporaries"
    STEP_GRADIENT_COPY = "fp32 gradient partition at step"
    MODEL_LOAD = "model load"  # host memory from_pretrained reads the checkpoint into


class Place(StrEnum):
    """Where, and during which part of the step, a state line holds memory."""

    GPU = "gpu"  # always resident on the device
    WINDOW_GRADS = "window grads"  # held between the micro-steps of an accumulation window
    STEP_TEMPS = "step temps"  # only during the optimizer step
    IN_LAYER = "in-layer"  # only while a decoder layer runs (FSDP2's gathered layers)
    HOST = "host"  # host RAM


@dataclass(frozen=True)
class StateLine:
    """One line of resident state: what it models, where it lives, its bytes and the label shown.

    `traced`: the FakeTensor trace (`trace.py`) measures this line itself (plain weights, autograd
    gradients, torch AdamW), so `untraced_state` adds only the others.
    """

    kind: StateKind
    place: Place
    bytes: int
    label: str
    traced: bool = False


@dataclass
class StateTerms:
    """Resident model state per rank (on the GPU, by phase) and on the host: typed lines, in bytes."""

    lines: list[StateLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Bytes of unsharded compute-dtype weights the trace holds that the engine does not (ZeRO-3 / FSDP).
    trace_weight_surplus: int = 0

    def add(self, kind: StateKind, place: Place, nbytes: int, label: str, traced: bool = False) -> None:
        """Append one line."""
        self.lines.append(StateLine(kind, place, nbytes, label, traced))

    def at(self, *places: Place) -> list[StateLine]:
        """The lines held at `places`, in the order they were counted."""
        return [line for line in self.lines if line.place in places]

    def bytes_at(self, *places: Place) -> int:
        """Total bytes at `places`."""
        return sum(line.bytes for line in self.at(*places))

    def bytes_of(self, *kinds: StateKind, place: Place | None = None) -> int:
        """Total bytes of the lines of `kinds` (at `place`, when given)."""
        return sum(line.bytes for line in self.lines if line.kind in kinds and place in (None, line.place))

    def labelled(self, *places: Place) -> dict[str, int]:
        """The lines at `places` as the breakdown shows them: label -> bytes."""
        return {line.label: line.bytes for line in self.at(*places)}


def model_state(scn: Scenario) -> StateTerms:
    """Weights, gradients, optimizer state, master copies and engine buffers, per rank (bytes)."""
    prof = compute_profile(scn)
    shape = model_shape(scn.model)
    counts = param_counts(scn)
    dp = scn.zero_ranks
    t = StateTerms()
    half_b = prof.half_bytes
    quant_b = sum(quantized_weight_bytes(o, i, scn) for o, i in counts.quantized_linears) * counts.layers
    # Frozen non-quantized weights: loaded in the load dtype, upcast to fp32 by k-bit preparation unless
    # quantization.fp32_residual is false.
    kbit_fp32 = scn.quantization != "none" and scn.fp32_residual
    frozen_b = dtype_bytes("fp32" if kbit_fp32 else prof.load)
    opt_state = optimizer_state_bytes(scn, counts.trainable_numels)
    # from_pretrained reads the checkpoint into host memory in the load dtype before the engine moves it.
    t.add(
        StateKind.MODEL_LOAD,
        Place.HOST,
        shape.total_params * dtype_bytes(prof.load) * dp,
        f"model load ({prof.load}, transient, x {dp} rank(s) on a node)",
    )
    qlabel = f"{scn.quantization} base weights (bitsandbytes, incl. absmax)"
    frozen_label = "frozen base weights" if scn.lora else "weights"
    if quant_b:
        frozen_label = "non-quantized base weights (embeddings, norms, lm_head; k-bit prepared)"
    if scn.strategy in ("single", "ddp"):
        return _local_state(
            scn,
            prof,
            t,
            counts,
            quant_b,
            qlabel,
            f"{frozen_label} ({dtype_label(frozen_b, prof.half)})",
            frozen_b,
            opt_state,
        )
    if scn.strategy == "deepspeed":
        return _deepspeed_state(scn, prof, t, counts, quant_b, qlabel, frozen_label, half_b, opt_state)
    return _fsdp_state(scn, prof, t, counts, shape, quant_b, qlabel, frozen_b, half_b, opt_state, dp)


def _local_state(
    scn: Scenario,
    prof: ComputeProfile,
    t: StateTerms,
    counts: ParamCounts,
    quant_b: int,
    qlabel: str,
    frozen_label: str,
    frozen_b: int,
    opt_state: int,
) -> StateTerms:
    """One process or DDP: every tensor whole on each rank; the trace sees weights, gradients and torch
    AdamW itself."""
    T = counts.trainable
    if quant_b:
        t.add(
            StateKind.QUANTIZED_WEIGHTS, Place.GPU, quant_b, qlabel, traced=True
        )  # half stand-ins in the trace
    if counts.frozen:
        t.add(StateKind.FROZEN_WEIGHTS, Place.GPU, counts.frozen * frozen_b, frozen_label, traced=True)
    # LoRA adapters stay fp32 (peft), full fine-tuning loads fp32.
    t.add(
        StateKind.TRAINABLE_WEIGHTS, Place.GPU, T * 4, f"trainable weights (fp32, {T:,} params)", traced=True
    )
    # torch's AdamW runs in the trace: its state is measured there (bitsandbytes' is not).
    adamw = scn.optimizer == "adamw"
    t.add(StateKind.OPTIMIZER_STATE, Place.GPU, opt_state, f"optimizer state ({scn.optimizer})", traced=adamw)
    t.add(StateKind.GRADIENTS, Place.WINDOW_GRADS, T * 4, "gradients (fp32)", traced=True)
    if scn.strategy == "ddp":
        # DDP's bucket buffers are a second copy of the gradients (gradient_as_bucket_view=False).
        t.add(StateKind.DDP_BUCKETS, Place.GPU, T * 4, "DDP gradient buckets (fp32)")
    if adamw:
        # foreach AdamW: one fp32 temporary the size of all parameters (sqrt of exp_avg_sq).
        t.add(
            StateKind.OPTIMIZER_TEMPORARIES,
            Place.STEP_TEMPS,
            T * 4,
            "AdamW foreach temporaries (fp32)",
            traced=True,
        )
    return t


def dtype_label(nbytes: int, half: str | None = "bf16") -> str:
    """A short dtype name for a breakdown line, from an element size (2 bytes: the run's half dtype)."""
    half = half or "bf16"
    names = {dtype_bytes("fp32"): "fp32", dtype_bytes(half): half, 1: "int8"}
    return names.get(nbytes, f"{nbytes} B")


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
    """DeepSpeed: weights in the half dtype (`_deepspeed_weights`), fp32 masters and optimizer state
    partitioned from stage 1, gradients partitioned from stage 2, optionally offloaded to the host."""
    # DeepSpeed casts every floating parameter to the half dtype (fp32 training: stays fp32).
    pb, pdt, T = half_b, dtype_label(half_b, prof.half), counts.trainable
    _deepspeed_weights(
        scn, t, counts, quant_b, qlabel, f"{frozen_label} + trainable weights ({pdt})", pb, pdt
    )
    mixed = prof.half is not None
    shard = scn.zero_ranks if scn.zero_stage >= 1 else 1
    where = Place.HOST if scn.offload_optimizer else Place.GPU
    suffix = f", 1/{shard}" if shard > 1 else ""
    if mixed and T * 4 // shard:
        t.add(StateKind.MASTER_WEIGHTS, where, T * 4 // shard, f"fp32 master weights (DeepSpeed{suffix})")
    opt_name = "DeepSpeed CPU Adam" if scn.ds_builds_optimizer else scn.optimizer
    t.add(StateKind.OPTIMIZER_STATE, where, opt_state // shard, f"optimizer state ({opt_name}{suffix})")
    # Gradients: ZeRO-0/1 accumulate full gradients in the parameter dtype (autograd's .grad); ZeRO-2/3
    # reduce each into a partition buffer (plus one reduce bucket) every micro-step.
    if scn.zero_stage <= 1:
        t.add(StateKind.GRADIENTS, Place.WINDOW_GRADS, T * pb, f"gradients ({pdt})", traced=True)
    else:
        bucket = min(T, model_shape(scn.model).hidden_size ** 2) * pb
        t.add(StateKind.REDUCE_BUCKET, Place.GPU, bucket, "ZeRO reduce bucket")
        if scn.offload_optimizer:
            label = f"gradient partition (fp32{suffix})"
            t.add(StateKind.GRADIENT_PARTITION, Place.HOST, T * 4 // shard, label)
        else:
            label = f"gradient partition ({pdt}{suffix})"
            t.add(StateKind.GRADIENT_PARTITION, Place.GPU, T * pb // shard, label)
    if mixed and not scn.offload_optimizer:
        # At the step the optimizer reads an fp32 copy of this rank's gradient partition.
        label = f"fp32 gradient partition at step{suffix}"
        t.add(StateKind.STEP_GRADIENT_COPY, Place.STEP_TEMPS, T * 4 // shard, label)
    return t


def _deepspeed_weights(
    scn: Scenario,
    t: StateTerms,
    counts: ParamCounts,
    quant_b: int,
    qlabel: str,
    weights_label: str,
    pb: int,
    pdt: str,
) -> None:
    """DeepSpeed's weights: whole on every rank up to ZeRO-2; ZeRO-3 keeps a 1/dp partition (or the host
    copy, offloaded) plus the parameters gathered while they run. Quantized weights stay whole."""
    dp = scn.zero_ranks
    if quant_b:
        t.add(StateKind.QUANTIZED_WEIGHTS, Place.GPU, quant_b, qlabel, traced=True)
    weights = (counts.frozen + counts.trainable) * pb
    if scn.zero_stage != 3:
        t.add(StateKind.WEIGHTS, Place.GPU, weights, weights_label, traced=True)
        return
    t.trace_weight_surplus = weights
    if scn.offload_params:
        t.add(StateKind.OFFLOADED_PARAMETERS, Place.HOST, weights, f"ZeRO-3 offloaded parameters ({pdt})")
        t.notes.append("parameters live on the host; the GPU holds only gathered layers")
    else:
        label = f"ZeRO-3 parameter partition ({pdt}, 1/{dp})"
        t.add(StateKind.PARAMETER_PARTITION, Place.GPU, weights // dp, label)
    live = min(counts.frozen + counts.trainable, ZERO3_MAX_LIVE_PARAMETERS) * pb
    label = "ZeRO-3 gathered parameters (up to stage3_max_live_parameters)"
    t.add(StateKind.GATHERED_PARAMETERS, Place.GPU, live, label)


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
    """FSDP2: every parameter, gradient and optimizer state sharded 1/dp in its original dtype; the root
    group gathered through the step, decoder layers only while they run; optionally on the host."""
    T = counts.trainable
    # The trace holds every weight unsharded in param_dtype, quantized ones as half-precision stand-ins
    # (`trace._emulate_quantization`): all of it is replaced by the shards below.
    t.trace_weight_surplus = (counts.frozen + counts.quantized + T) * half_b
    where = Place.HOST if scn.fsdp_cpu_offload else Place.GPU
    sharded = (quant_b + counts.frozen * frozen_b + T * 4) // dp
    t.add(StateKind.SHARDED_WEIGHTS, where, sharded, f"sharded weights (original dtypes, 1/{dp})")
    # Unsharded in param_dtype: the root group (embeddings, final norm, lm_head) stays gathered through the
    # step; decoder layers are gathered one at a time plus the next one prefetched, only while layers run
    # (the loss and the optimizer step see the root alone: measured on one GPU, docs/platform.md).
    layer_numel = shape.layer_params + (counts.trainable // shape.num_layers if scn.lora else 0)
    root_numel = shape.total_params - shape.num_layers * shape.layer_params
    half = dtype_label(half_b, prof.half)
    label = f"gathered weights: root (embeddings, final norm, lm_head; {half})"
    t.add(StateKind.GATHERED_ROOT, Place.GPU, root_numel * half_b, label)
    label = f"gathered weights: 2 decoder layers (running + prefetched; {half})"
    t.add(StateKind.GATHERED_LAYERS, Place.IN_LAYER, 2 * layer_numel * half_b, label)
    grads_label = f"sharded gradients (fp32, 1/{dp})"
    t.add(StateKind.SHARDED_GRADIENTS, Place.GPU, T * 4 // dp if not scn.fsdp_cpu_offload else 0, grads_label)
    if scn.fsdp_cpu_offload:
        t.add(StateKind.SHARDED_GRADIENTS, Place.HOST, T * 4 // dp, grads_label)
    t.add(StateKind.OPTIMIZER_STATE, where, opt_state // dp, f"optimizer state ({scn.optimizer}, 1/{dp})")
    if scn.grad_accum_steps > 1 and not scn.fsdp_cpu_offload:
        # set_requires_gradient_sync(False): unsharded gradients accumulate in reduce_dtype (fp32).
        label = "unsharded accumulated gradients (fp32, no-sync window)"
        t.add(StateKind.ACCUMULATED_GRADIENTS, Place.WINDOW_GRADS, T * 4, label)
    if scn.optimizer == "adamw":
        label = "AdamW foreach temporaries (fp32, sharded)"
        t.add(StateKind.OPTIMIZER_TEMPORARIES, Place.STEP_TEMPS, T * 4 // dp, label)
    return t
