"""The analytic memory model: per-rank peak GPU memory of one training step, with a breakdown to check by hand.

Everything is counted in bytes from the model's exact shapes (`shapes.py`) and what zerofit's engines do
(`model.py`, `strategies/`, `train.py`), then reported in GiB. The model mirrors, term by term, what a
tensor-level trace of the step sees (`trace.py`), and the tests hold the two within 5% across a matrix.

Peak = max over the two phases of a step:

  forward/backward = resident state + gradients held from earlier micro-steps of the window
                     + activations at their peak (all layers' saved tensors, the logits and the loss's fp32
                       temporaries, or with checkpointing the layer inputs + one recomputed layer)
  optimizer step   = resident state + gradients + the optimizer's temporaries

Resident state = weights as the engine holds them (dtype, quantization, ZeRO / FSDP sharding, offload)
+ optimizer state + master weights (DeepSpeed, mixed precision) + the engine's gradient buffers.

`total` adds a stated allowance for what is not a tensor: the CUDA context, cuBLAS workspace, NCCL buffers and
caching-allocator fragmentation (constants below, documented where they are defined).

Activation bytes per token of one decoder layer are a sum of named terms (see `_layer_terms`). The rules come
from which tensors autograd saves for backward:
  - RMSNorm saves its fp32 upcast input and the per-token rstd (and its normalized output when its weight
    trains);
  - a linear saves its input only when its weight trains; a frozen base linear saves nothing, its LoRA
    adapter saves its own input: the same storage as the base's input when the dtypes agree, else its own
    cast copy (fp32 adapters under a bf16 base, or a bf16 copy under autocast), plus the rank-r output of A;
  - attention (sdpa) saves q, k, v, the output and a per-head logsumexp; eager attention also keeps the
    S x S probabilities (fp32 softmax output and its half copy);
  - SwiGLU saves gate and up outputs and the activation's output;
  - dropout keeps a one-byte mask per element (CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from zerofit.planner.shapes import LoraShape, ModelShape, lora_shape, model_shape

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# --- Allowance: device memory that is not a tensor (documented constants) --------------------------------
# The CUDA context (driver state, kernels of torch, cuBLAS and cuDNN loaded on first use) is not counted by
# torch.cuda.memory_allocated but occupies the card: about 0.3-0.5 GiB on Ampere/Hopper with torch 2.x.
CUDA_CONTEXT_GIB = 0.5
# cuBLAS/cuBLASLt workspaces and other per-stream scratch (a few MiB each, several streams).
WORKSPACE_GIB = 0.1
# NCCL communicator buffers when there is more than one rank.
NCCL_GIB = 0.3
# The caching allocator rounds blocks and cannot always reuse freed ones: reserved exceeds allocated by
# roughly 5-10% in steady state for these workloads; 8% of the tensor peak is held back for it.
FRAGMENTATION_FRACTION = 0.08

# torch AdamW keeps `step` as a host tensor (foreach/for-loop default): no device bytes.
# bitsandbytes' 8-bit optimizers keep 8-bit state only for tensors of at least this many elements.
BNB_MIN_8BIT_SIZE = 4096
BNB_OPT_BLOCK = 256
# DeepSpeed ZeRO-3 keeps up to this many gathered parameter elements live (stage3_max_live_parameters).
ZERO3_MAX_LIVE_PARAMETERS = 10**9


@dataclass(frozen=True)
class Scenario:
    """Everything the memory of one training step depends on (built from a config by `scenario_from_config`)."""

    model: str
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int = 1
    dp_size: int = 1
    strategy: str = "single"  # single | ddp | deepspeed | fsdp
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    ds_builds_optimizer: bool = False  # DeepSpeed's own (CPU) Adam instead of the client optimizer
    fsdp_cpu_offload: bool = False
    precision: str = "bf16"
    lora: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | str = "all-linear"
    use_dora: bool = False
    quantization: str = "none"  # none | 8bit | 4bit
    double_quant: bool = True
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    # None = what the strategy does (autocast for single/ddp in bf16/fp16). False reproduces a plain step
    # without autocast (how ../shared/PLATFORM.md's reference figures were measured).
    autocast: bool | None = None

    def with_micro(self, micro: int, grad_accum_steps: int) -> Scenario:
        """The same run at another micro-batch size (and the accumulation that keeps the global batch)."""
        return replace(self, micro_batch_size=micro, grad_accum_steps=grad_accum_steps)


@dataclass(frozen=True)
class ComputeProfile:
    """Dtypes the engine computes and stores in, derived from the scenario (what model.py + strategies do)."""

    load: str  # dtype from_pretrained loads in (model.load_dtype's rule)
    half: str | None  # bf16/fp16 when training in half precision
    autocast: bool  # single/ddp: torch.autocast around forward and backward
    cast_params_to: str | None  # DeepSpeed / FSDP2: every parameter computes in this dtype
    traced_optimizer: bool  # the optimizer is a torch AdamW the trace can run
    grads_leave_autograd: bool  # the engine moves each gradient into its own (partitioned) buffer at once

    @property
    def load_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.load]

    @property
    def half_dtype(self) -> Any:
        import torch

        return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.half]

    @property
    def cast_dtype(self) -> Any:
        import torch

        return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            self.cast_params_to
        ]


def compute_profile(scn: Scenario) -> ComputeProfile:
    """The engine's dtypes for `scn` (mirrors model.load_dtype, the strategies and render.py)."""
    half = scn.precision if scn.precision in ("bf16", "fp16") else None
    load = half if (half and scn.lora) else "fp32"
    autocast = scn.strategy in ("single", "ddp") and half is not None
    if scn.autocast is not None:
        autocast = scn.autocast and half is not None
    cast = half if scn.strategy in ("deepspeed", "fsdp") and half else None
    fsdp_sync_each = scn.strategy == "fsdp" and (scn.grad_accum_steps == 1 or scn.fsdp_cpu_offload)
    return ComputeProfile(
        load=load,
        half=half,
        autocast=autocast,
        cast_params_to=cast,
        traced_optimizer=scn.strategy in ("single", "ddp") and scn.optimizer == "adamw",
        grads_leave_autograd=(scn.strategy == "deepspeed" and scn.zero_stage >= 2) or fsdp_sync_each,
    )


# ------------------------------------------------------------------------------------ scenario from config


def scenario_from_config(
    cfg: ZerofitConfig,
    world_size: int,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
) -> Scenario:
    """The memory scenario of a (resolved or auto) config at `world_size` ranks.

    `micro_batch_size` / `grad_accum_steps` override the config's (the micro-batch search varies them).
    """
    from zerofit.presets import DEFAULT_PRESET, get_preset

    strategy = cfg.distributed.strategy
    preset_name = cfg.distributed.preset or DEFAULT_PRESET.get(strategy)
    body: dict[str, Any] = {}
    if cfg.distributed.ds_config is not None and strategy == "deepspeed":
        import json
        from pathlib import Path

        try:
            body = json.loads(Path(cfg.distributed.ds_config).read_text())
        except (OSError, ValueError):
            body = {}
    elif preset_name is not None:
        body = get_preset(preset_name).body
    zero = body.get("zero_optimization") if isinstance(body.get("zero_optimization"), dict) else {}
    zero = zero or {}

    def _offloaded(key: str) -> bool:
        block = zero.get(key) or {}
        return isinstance(block, dict) and block.get("device", "none") not in ("none", None)

    offload_opt = strategy == "deepspeed" and _offloaded("offload_optimizer")
    micro = micro_batch_size if micro_batch_size is not None else cfg.batch.micro_batch_size
    if not isinstance(micro, int):
        micro = 1
    gas = grad_accum_steps if grad_accum_steps is not None else (cfg.batch.grad_accum_steps or 1)
    return Scenario(
        model=cfg.model.name_or_path,
        seq_len=cfg.data.max_seq_len,
        micro_batch_size=micro,
        grad_accum_steps=gas,
        dp_size=world_size,
        strategy=strategy,
        zero_stage=int(zero.get("stage", 0)) if strategy == "deepspeed" else 0,
        offload_optimizer=offload_opt,
        offload_params=strategy == "deepspeed" and _offloaded("offload_param"),
        ds_builds_optimizer=strategy == "deepspeed"
        and ("optimizer" in body or (offload_opt and cfg.optimizer.name == "adamw")),
        fsdp_cpu_offload=strategy == "fsdp" and bool(body.get("cpu_offload", False)),
        precision=cfg.train.precision,
        lora=cfg.lora.enabled,
        lora_r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        lora_targets=cfg.lora.target_modules
        if isinstance(cfg.lora.target_modules, str)
        else tuple(cfg.lora.target_modules),
        use_dora=cfg.lora.use_dora,
        quantization=cfg.quantization.load_in,
        double_quant=cfg.quantization.double_quant,
        optimizer=cfg.optimizer.name,
        activation_checkpointing=cfg.train.activation_checkpointing,
        attn_implementation=cfg.model.attn_implementation,
    )


# ----------------------------------------------------------------------------------------- model state


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
    host: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # For the trace: lines it measures itself (plain weights, autograd gradients, torch AdamW), and bytes
    # of unsharded compute-dtype weights it holds that the engine does not (ZeRO-3 / FSDP shard them).
    traced: set[str] = field(default_factory=set)
    trace_weight_surplus: int = 0


def model_state(scn: Scenario) -> StateTerms:
    """Weights, gradients, optimizer state, master copies and engine buffers, per rank (bytes)."""
    prof = compute_profile(scn)
    shape = model_shape(scn.model)
    counts = param_counts(scn)
    dp = max(scn.dp_size, 1)
    t = StateTerms()
    T = counts.trainable
    half_b = DTYPE_BYTES[prof.half] if prof.half else 4
    quant_b = sum(quantized_weight_bytes(o, i, scn) for o, i in counts.quantized_linears) * counts.layers
    # Frozen non-quantized weights: loaded in the load dtype, upcast to fp32 by k-bit preparation.
    frozen_b = 4 if scn.quantization != "none" else DTYPE_BYTES[prof.load]
    train_b = 4  # LoRA adapters stay fp32 (peft), full fine-tuning loads fp32
    opt_state = optimizer_state_bytes(scn, counts.trainable_numels)
    # from_pretrained reads the checkpoint into host memory in the load dtype before the engine moves it.
    base_params = shape.total_params
    t.host[f"model load ({prof.load}, transient, x {dp} rank(s) on a node)"] = (
        base_params * DTYPE_BYTES[prof.load] * dp
    )
    qlabel = f"{scn.quantization} base weights (bitsandbytes, incl. absmax)"
    frozen_label = "frozen base weights" if scn.lora else "weights"
    if quant_b:
        frozen_label = "non-quantized base weights (embeddings, norms, lm_head; k-bit prepared)"

    if scn.strategy in ("single", "ddp"):
        if quant_b:
            t.gpu[qlabel] = quant_b
            t.traced.add(qlabel)  # traced as half stand-ins; the trace swaps the bytes
        if counts.frozen:
            t.gpu[f"{frozen_label} ({_dt(frozen_b, prof.half)})"] = counts.frozen * frozen_b
            t.traced.add(f"{frozen_label} ({_dt(frozen_b, prof.half)})")
        t.gpu[f"trainable weights (fp32, {T:,} params)"] = T * train_b
        t.gpu[f"optimizer state ({scn.optimizer})"] = opt_state
        t.window_grads["gradients (fp32)"] = T * 4
        t.traced.update([f"trainable weights (fp32, {T:,} params)", "gradients (fp32)"])
        if scn.strategy == "ddp":
            # DDP's bucket buffers are a second copy of the gradients (gradient_as_bucket_view=False).
            t.gpu["DDP gradient buckets (fp32)"] = T * 4
        if scn.optimizer == "adamw":
            # foreach AdamW: one fp32 temporary the size of all parameters (sqrt of exp_avg_sq).
            t.step_temps["AdamW foreach temporaries (fp32)"] = T * 4
            t.traced.update([f"optimizer state ({scn.optimizer})", "AdamW foreach temporaries (fp32)"])
        return t

    if scn.strategy == "deepspeed":
        return _deepspeed_state(scn, prof, t, counts, quant_b, qlabel, frozen_label, half_b, opt_state)
    return _fsdp_state(scn, prof, t, counts, shape, quant_b, qlabel, frozen_b, half_b, opt_state, dp)


def _dt(nbytes: int, half: str | None = "bf16") -> str:
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
        t.gpu[qlabel] = quant_b
        t.traced.add(qlabel)
    weights = (counts.frozen + T) * pb
    if shard_params:
        t.trace_weight_surplus = weights
        live = min(counts.frozen + T, ZERO3_MAX_LIVE_PARAMETERS) * pb
        if scn.offload_params:
            t.host[f"ZeRO-3 offloaded parameters ({_dt(pb, prof.half)})"] = weights
            t.notes.append("parameters live on the host; the GPU holds only gathered layers")
        else:
            t.gpu[f"ZeRO-3 parameter partition ({_dt(pb, prof.half)}, 1/{dp})"] = weights // dp
        t.gpu["ZeRO-3 gathered parameters (up to stage3_max_live_parameters)"] = live
    else:
        t.gpu[f"{frozen_label} + trainable weights ({_dt(pb, prof.half)})"] = weights
        t.traced.add(f"{frozen_label} + trainable weights ({_dt(pb, prof.half)})")
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
        t.window_grads[f"gradients ({_dt(pb, prof.half)})"] = T * pb
        t.traced.add(f"gradients ({_dt(pb, prof.half)})")  # autograd's own .grad tensors
    else:
        t.gpu["ZeRO reduce bucket"] = bucket
        if scn.offload_optimizer:
            t.host[f"gradient partition (fp32{suffix})"] = T * 4 // shard
        else:
            t.gpu[f"gradient partition ({_dt(pb, prof.half)}{suffix})"] = T * pb // shard
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
    # step; decoder layers are gathered one at a time plus the next one prefetched.
    layer_numel = shape.layer_params + (counts.trainable // shape.num_layers if scn.lora else 0)
    root_numel = shape.total_params - shape.num_layers * shape.layer_params
    t.gpu[f"gathered weights: root + 2 layers ({_dt(half_b, prof.half)})"] = (
        root_numel + 2 * layer_numel
    ) * half_b
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


# ----------------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class _Dt:
    """Per-element byte sizes of the tensors in a decoder layer under a compute profile."""

    resid: int  # residual stream (embedding output dtype)
    lin_out: int  # output of a base linear
    att: int  # tensors attention saves
    logits: int
    adapter: int  # LoRA compute dtype without autocast
    autocast_half: int | None  # half dtype when autocast is on


def _dtypes(scn: Scenario, prof: ComputeProfile) -> _Dt:
    half_b = DTYPE_BYTES[prof.half] if prof.half else 4
    if prof.cast_params_to is not None:
        store = half_b  # DeepSpeed / FSDP2: everything computes in the half dtype
        adapter = half_b
    else:
        store = 4 if (scn.quantization != "none" or prof.load == "fp32") else DTYPE_BYTES[prof.load]
        adapter = 4
    resid = store
    ac = half_b if prof.autocast else None
    # bitsandbytes returns its output in the input's dtype; otherwise autocast or the weights decide.
    lin_out = resid if scn.quantization != "none" else (ac or store)
    att = ac or lin_out
    logits = ac or store
    return _Dt(resid=resid, lin_out=lin_out, att=att, logits=logits, adapter=adapter, autocast_half=ac)


_GROUP_OF = {
    "q_proj": "attn_in",
    "k_proj": "attn_in",
    "v_proj": "attn_in",
    "o_proj": "o_in",
    "gate_proj": "mlp_in",
    "up_proj": "mlp_in",
    "down_proj": "down_in",
}
_POST_ATTENTION_GROUPS = ("o_in", "mlp_in", "down_in")


def _layer_terms(scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt) -> list[tuple[str, int]]:
    """Bytes saved for backward per token by one decoder layer, as named terms."""
    return _layer_split(scn, shape, lora, dt)[0]


def _layer_split(
    scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt
) -> tuple[list[tuple[str, int]], int]:
    """`_layer_terms`, plus how many of those bytes belong after attention (o_proj, norm 2, the MLP)."""
    h, inter = shape.hidden_size, shape.intermediate_size
    q_dim, kv_dim, heads = shape.q_dim, shape.kv_dim, shape.num_heads
    full = not scn.lora
    terms: list[tuple[str, int]] = []
    # RMSNorm x2: fp32 upcast input + rstd; normalized output too when the norm weight trains.
    norm = 4 * h + 4 + (dt.resid * h if full else 0)
    terms.append(("2 RMSNorms (fp32 input, rstd" + (", normalized output)" if full else ")"), 2 * norm))

    masked = scn.micro_batch_size > 1  # zerofit pads micro-batches of >1 sequence: masked attention
    kv_saved = q_dim if (masked or scn.attn_implementation == "eager") else kv_dim
    if scn.attn_implementation == "eager":
        s = scn.seq_len
        attn = dt.att * (q_dim + 2 * kv_saved) + 4 * heads * s + dt.att * heads * s
        terms.append(
            (f"eager attention: q, k and v (repeated to all heads), fp32 softmax + probs (S={s})", attn)
        )
    else:
        attn = dt.att * (2 * q_dim + 2 * kv_saved) + 4 * heads
        terms.append(("sdpa attention: q, k, v, output, logsumexp", attn))
        if masked:
            # sdpa converts the boolean padding mask to an additive one per call and keeps it for backward.
            terms.append((f"sdpa additive padding mask (S={scn.seq_len})", dt.att * scn.seq_len))
    # SwiGLU: gate output (activation input), activation output, up output.
    mlp_b = dt.lin_out
    swiglu = 3 * mlp_b * inter
    terms.append(("SwiGLU: gate, act(gate), up outputs", swiglu))
    post_attention = norm + swiglu

    # Linear inputs, by the tensor they read: (width, dtype of that tensor, already saved by attention).
    groups = {
        "attn_in": (h, dt.resid, False),
        "o_in": (q_dim, dt.att, scn.attn_implementation == "sdpa"),
        "mlp_in": (h, dt.resid, False),
        "down_in": (inter, mlp_b, False),
    }
    shared_saved: set[str] = set()
    own_copies = lora_rank_io = dropout_masks = 0
    targets = {t.name.rpartition(".")[2] for t in (lora.layer_targets if lora else ())}
    ac = dt.autocast_half
    for lin in shape.linears:
        short = lin.name.rpartition(".")[2]
        group = _GROUP_OF.get(short, lin.name)
        width, x_b, _ = groups.get(group, (lin.in_features, dt.resid, False))
        before = own_copies + lora_rank_io + dropout_masks
        if full:
            if ac is not None and x_b != ac:
                own_copies += ac * width  # autocast casts the input for each linear
            else:
                shared_saved.add(group)
        if short in targets and lora is not None:
            if scn.lora_dropout > 0:
                dropout_masks += width
                # dropout output in the adapter dtype; under autocast A saves a half copy of it instead
                own_copies += (ac or dt.adapter) * width
            elif ac is not None:
                if x_b != ac or dt.adapter != ac:
                    own_copies += ac * width
                else:
                    shared_saved.add(group)
            elif x_b != dt.adapter:
                own_copies += dt.adapter * width  # peft casts the input to the adapter dtype
            else:
                shared_saved.add(group)
            lora_rank_io += (ac or dt.adapter) * lora.r
        if group in _POST_ATTENTION_GROUPS:
            post_attention += own_copies + lora_rank_io + dropout_masks - before
    counted = [g for g in shared_saved if g in groups and not groups[g][2]]
    shared = sum(groups[g][0] * groups[g][1] for g in counted)
    post_attention += sum(groups[g][0] * groups[g][1] for g in counted if g in _POST_ATTENTION_GROUPS)
    if shared:
        terms.append(("linear inputs shared by the projections reading them", shared))
    if own_copies:
        terms.append(("per-linear input copies (dtype casts / dropout outputs)", own_copies))
    if lora_rank_io:
        terms.append((f"LoRA A outputs (rank {lora.r if lora else 0})", lora_rank_io))
    if dropout_masks:
        terms.append(("LoRA dropout masks (1 byte)", dropout_masks))
    return terms, post_attention


@dataclass
class ActivationTerms:
    """Activation-side bytes at the forward/backward peak, with named lines (bytes)."""

    peak: int
    lines: dict[str, int]
    where: str  # which moment of the step is the peak
    per_layer_token_terms: list[tuple[str, int]]


def _autocast_weight_copies(scn: Scenario, shape: ModelShape, counts: ParamCounts, dt: _Dt) -> int:
    """Half copies of fp32 matmul weights that autocast caches for the whole forward+backward."""
    if dt.autocast_half is None:
        return 0
    half = dt.autocast_half
    copies = 0
    if scn.lora:
        copies += half * counts.trainable  # fp32 adapters: A and B cast once per step
    else:
        copies += half * sum(lin.params for lin in shape.linears) * shape.num_layers
    head_fp32 = not scn.lora or scn.quantization != "none"  # full fine-tuning or k-bit prepared head
    if head_fp32:
        copies += half * shape.vocab_size * shape.hidden_size
    return copies


@dataclass(frozen=True)
class _Transients:
    """Per-token bytes of short-lived tensors at the two moments inside a decoder layer that can be the peak."""

    forward_extra: int  # end of forward, last layer's down projection: live tensors not (yet) saved
    backward_extra: int  # backward of a layer's down projection: gradients in flight minus what it freed
    incoming_grads: int  # gradients waiting when a checkpointed layer starts recomputing


def _transients(scn: Scenario, shape: ModelShape, lora: LoraShape | None, dt: _Dt) -> _Transients:
    """Working sets around the widest op of a layer (the MLP's down projection, I = intermediate wide).

    Forward, as the last layer computes its down projection: the residual stream and the base output
    (h wide), the SwiGLU product if nothing saved it, and under autocast the fp32 cast peft makes for
    the adapter before autocast takes its half copy.
    Backward, as gradients reach the down projection's input: the incoming residual gradient (h wide), the
    base and adapter partial gradients and their sum (I wide; an fp32 adapter partial is cast down
    first), minus what the down projection's nodes saved and have just released.
    """
    h, inter = shape.hidden_size, shape.intermediate_size
    m, ac, a = dt.lin_out, dt.autocast_half, dt.adapter
    full = not scn.lora
    targets = {t.name.rpartition(".")[2] for t in (lora.layer_targets if lora else ())}
    lora_down = "down_proj" in targets
    dropout = lora_down and scn.lora_dropout > 0
    lora_c = ac or a  # dtype of the adapter's matmuls (and their input gradients)
    if full:
        p_shared = not (ac is not None and m != ac)
        own_copy = 0 if p_shared else (ac or m)
    else:
        p_shared = False
        own_copy = 0
    lora_copy = 0
    if lora_down:
        if dropout:
            lora_copy = lora_c
        elif ac is not None:
            if m == ac and a == ac:
                p_shared = True
            else:
                lora_copy = ac
        elif m == a:
            p_shared = True
        else:
            lora_copy = a
    freed = (m * inter if p_shared else 0) + (own_copy + lora_copy) * inter
    if lora_down:
        freed += lora_c * (lora.r if lora else 0) + (inter if dropout else 0)
    cast_partial = lora_down and lora_c != m
    partials = max(3 * m, 2 * m + lora_c if cast_partial else 0) * inter
    backward_extra = dt.resid * h + partials - freed
    forward_extra = dt.resid * h + m * h + (0 if p_shared else m * inter)
    if lora_down and m != a and (ac is not None or dropout):
        forward_extra += a * inter  # peft's cast of the input, alive while the adapter's copy is made
    if dropout and ac is not None:
        forward_extra += a * inter  # the dropout output, alive while autocast makes its half copy
    # The gradient at the layer's output; with an adapter on the down projection also its scaled copy for
    # the adapter branch (and that copy's cast), all alive when the recomputation is triggered.
    incoming = dt.resid * h + (2 * lora_c * h if lora_down else 0)
    return _Transients(forward_extra=forward_extra, backward_extra=backward_extra, incoming_grads=incoming)


def activation_terms(scn: Scenario) -> ActivationTerms:
    """Activations, logits and loss temporaries at the forward/backward peak (bytes, per rank).

    Candidates (the largest is the peak):
      - end of forward (no checkpointing): every layer's saved tensors + the last layer's live set;
      - loss backward: saved tensors (or checkpointed inputs) + logits + log-probabilities + the two fp32
        (tokens x vocab) gradients of the cross-entropy backward;
      - backward of the last layer (recomputed under checkpointing): its saved tensors + the gradients in
        flight around its down projection, with the logits still held by the training loop.
    """
    prof = compute_profile(scn)
    shape = model_shape(scn.model)
    lora = lora_shape(scn.model, scn.lora_r, scn.lora_targets, scn.use_dora) if scn.lora else None
    counts = param_counts(scn)
    dt = _dtypes(scn, prof)
    b, s = scn.micro_batch_size, scn.seq_len
    tokens, ce_tokens = b * s, b * (s - 1)
    h, v, n_layers = shape.hidden_size, shape.vocab_size, shape.num_layers
    full = not scn.lora

    terms, post_attention_tok = _layer_split(scn, shape, lora, dt)
    per_layer_tok = sum(n for _, n in terms)
    tr = _transients(scn, shape, lora, dt)
    # Under LoRA nothing before layer 0's first adapter needs a gradient: its first RMSNorm saves nothing.
    layer0_saving = 0 if (full or scn.activation_checkpointing) else 4 * h + 4

    # Shared by all layers: rotary cos/sin (one sequence wide). The boolean padding mask (B x 1 x S x S)
    # lives through the forward; under checkpointing every layer keeps it as an input until backward.
    rope = 2 * s * shape.head_dim * dt.resid
    bool_mask = b * s * s if (b > 1 and scn.attn_implementation == "sdpa") else 0
    base: dict[str, int] = {}
    copies = _autocast_weight_copies(scn, shape, counts, dt)
    if copies:
        base["autocast half copies of fp32 matmul weights"] = copies
    if scn.activation_checkpointing:
        base[f"checkpointed layer inputs ({n_layers} layers x {tokens} tokens x {dt.resid * h:,} B)"] = (
            n_layers * dt.resid * h * tokens
        )
        base["rotary cos/sin + boolean padding mask (kept by the checkpoints)"] = rope + bool_mask
    else:
        base[f"saved activations ({n_layers} layers x {tokens} tokens x {per_layer_tok:,} B)"] = (
            n_layers * per_layer_tok - layer0_saving
        ) * tokens
        base["rotary cos/sin"] = rope

    final_norm = (4 * h + 4 + (dt.resid * h if full else 0)) * tokens
    head_input = 0
    ids = 8 * tokens if full else 0  # the embedding's backward keeps the input ids
    if full:
        ac = dt.autocast_half
        head_input = (ac if ac and dt.resid != ac else dt.resid) * h * tokens
    logits_key = f"logits ({_dt(dt.logits, prof.half)}, {tokens} x {v:,}), held by the training loop"
    logits = dt.logits * v * tokens
    head_grad = 4 * v * h if full and not prof.grads_leave_autograd else 0

    candidates: list[tuple[str, dict[str, int]]] = []
    candidates.append(
        (
            "loss backward (cross-entropy's fp32 gradients)",
            {
                "final norm + lm_head saved inputs": final_norm + head_input + ids,
                logits_key: logits,
                "log-probabilities (fp32) + targets": 4 * v * ce_tokens + 8 * ce_tokens,
                "cross-entropy backward: 2 fp32 (tokens x vocab) gradients": 8 * v * ce_tokens,
            },
        )
    )
    last_layer = {logits_key: logits}
    if ids:
        last_layer["input ids (embedding backward)"] = ids
    # A recomputed layer's first RMSNorm saves its input; in fp32 that is the checkpointed input itself.
    recomputed_tok = per_layer_tok - (4 * h if dt.resid == 4 else 0)
    recomputed = f"recomputed last layer ({tokens} tokens x {recomputed_tok:,} B)"
    if scn.activation_checkpointing:
        last_layer[recomputed] = recomputed_tok * tokens
    last_layer["gradients in flight at its down projection"] = tr.backward_extra * tokens
    if head_grad:
        last_layer["lm_head weight gradient (fp32)"] = head_grad
    candidates.append(
        ("backward of the last layer" + (" (recomputed)" if scn.activation_checkpointing else ""), last_layer)
    )
    if scn.attn_implementation == "eager":
        # Eager attention's backward: the fp32 gradient of the softmax output and the softmax backward's
        # fp32 result (both heads x S wide per token) while the half probabilities are already released.
        # Everything the layer saved after attention has been released by then.
        att_bwd = {k: n for k, n in last_layer.items() if k != "gradients in flight at its down projection"}
        if scn.activation_checkpointing:
            att_bwd[recomputed] -= post_attention_tok * tokens
        att_bwd["eager attention backward: 2 fp32 (heads x S) gradients, later saves released"] = (
            (8 - dt.att) * shape.num_heads * s
            + dt.resid * h
            - (0 if scn.activation_checkpointing else post_attention_tok)
        ) * tokens
        candidates.append(("eager attention backward of the last layer", att_bwd))
    live = {"live tensors around the last layer's down projection": tr.forward_extra * tokens}
    if ids:
        live["input ids (embedding backward)"] = ids
    if scn.activation_checkpointing:
        # The recomputation inside backward runs the layer's forward again with the logits still held.
        recompute = {logits_key: logits, recomputed: recomputed_tok * tokens, **live}
        recompute["gradients waiting at the layer's output"] = tr.incoming_grads * tokens
        candidates.append(("recomputation of the last layer in backward", recompute))
    else:
        # Forward keeps the embedding output (the model's local) and the boolean mask alive throughout.
        fwd_common = {
            "embedding output + boolean padding mask (forward only)": dt.resid * h * tokens + bool_mask
        }
        candidates.append(("end of forward (last layer's down projection)", {**fwd_common, **live}))
        # The final RMSNorm: its input, fp32 upcast (saved; the input itself when already fp32) and rstd,
        # the fp32 product, and two results in the residual dtype.
        upcast = 4 * h if dt.resid != 4 else 0
        final_norm_fwd = (3 * dt.resid * h + upcast + 4 * h + 8) * tokens
        candidates.append(
            ("end of forward (final norm)", {**fwd_common, "final norm forward": final_norm_fwd})
        )
    where, extra = max(candidates, key=lambda c: sum(c[1].values()))
    lines = {**base, **extra}
    return ActivationTerms(peak=sum(lines.values()), lines=lines, where=where, per_layer_token_terms=terms)


# ----------------------------------------------------------------------------------------- the estimate


@dataclass
class MemoryEstimate:
    """Per-rank peak GPU memory of one step, its breakdown (GiB) and the host RAM the run needs."""

    scenario: Scenario
    tensors_gib: float  # peak bytes of live tensors (comparable to a trace / torch.cuda.max_memory_allocated)
    total_gib: float  # tensors + allowance (what the card must hold)
    allowance_gib: float
    breakdown: dict[str, float]  # named GiB lines of the peak phase; they sum to tensors_gib
    allowance: dict[str, float]
    peak_phase: str
    phases_gib: dict[str, float]
    host_ram_gib: float
    host_breakdown: dict[str, float]
    per_layer_token_bytes: dict[str, int]
    notes: list[str]

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (the `memory` block of `zerofit plan --json`)."""
        return {
            "tensors_gib": round(self.tensors_gib, 3),
            "total_gib": round(self.total_gib, 3),
            "allowance_gib": round(self.allowance_gib, 3),
            "breakdown": {k: round(v, 4) for k, v in self.breakdown.items()},
            "allowance": {k: round(v, 3) for k, v in self.allowance.items()},
            "peak_phase": self.peak_phase,
            "phases_gib": {k: round(v, 3) for k, v in self.phases_gib.items()},
            "host_ram_gib": round(self.host_ram_gib, 2),
            "host_breakdown": {k: round(v, 3) for k, v in self.host_breakdown.items()},
            "activation_bytes_per_token_per_layer": self.per_layer_token_bytes,
            "micro_batch_size": self.scenario.micro_batch_size,
            "seq_len": self.scenario.seq_len,
            "notes": self.notes,
        }


def allowance_gib(tensors_gib: float, dp_size: int) -> dict[str, float]:
    """The non-tensor device memory held back on top of the tensor peak (see the constants above)."""
    out = {
        "CUDA context": CUDA_CONTEXT_GIB,
        "cuBLAS workspace": WORKSPACE_GIB,
        f"allocator fragmentation ({FRAGMENTATION_FRACTION:.0%} of tensors)": FRAGMENTATION_FRACTION
        * tensors_gib,
    }
    if dp_size > 1:
        out["NCCL buffers"] = NCCL_GIB
    return out


def estimate(scn: Scenario) -> MemoryEstimate:
    """The analytic per-rank peak for `scn`, with a breakdown a reader can check by hand."""
    state = model_state(scn)
    acts = activation_terms(scn)
    resident = sum(state.gpu.values())
    window = sum(state.window_grads.values())
    held = window if scn.grad_accum_steps > 1 else 0
    fwd = resident + held + acts.peak
    step = resident + window + sum(state.step_temps.values())
    breakdown: dict[str, int] = dict(state.gpu)
    if fwd >= step:
        phase = f"forward/backward: {acts.where}"
        if held:
            breakdown.update({f"{k} held across the window": n for k, n in state.window_grads.items()})
        breakdown.update({f"activations: {k}": n for k, n in acts.lines.items()})
    else:
        phase = "optimizer step"
        breakdown.update(state.window_grads)
        breakdown.update(state.step_temps)
    tensors = max(fwd, step)
    tensors_gib = tensors / GIB
    allowance = allowance_gib(tensors_gib, scn.dp_size)
    host = dict(state.host)
    host_gib = sum(host.values()) / GIB
    notes = list(state.notes)
    if (scn.quantization != "none" and scn.strategy in ("fsdp",)) or (
        scn.quantization != "none" and scn.zero_stage == 3
    ):
        notes.append(
            "k-bit quantized weights are not shardable by ZeRO-3 / FSDP: this combination is refused"
        )
    return MemoryEstimate(
        scenario=scn,
        tensors_gib=tensors_gib,
        total_gib=tensors_gib + sum(allowance.values()),
        allowance_gib=sum(allowance.values()),
        breakdown={k: n / GIB for k, n in breakdown.items() if n},
        allowance=allowance,
        peak_phase=phase,
        phases_gib={"forward/backward": fwd / GIB, "optimizer step": step / GIB},
        host_ram_gib=host_gib,
        host_breakdown={k: n / GIB for k, n in host.items() if n},
        per_layer_token_bytes=dict(acts.per_layer_token_terms),
        notes=notes,
    )


def untraced_state(scn: Scenario) -> tuple[int, int | None, list[str]]:
    """What the fake-tensor trace cannot see: (resident bytes to add, optimizer-step peak or None, notes).

    The trace runs the model (weights in the engine's compute dtypes, unsharded), autograd and, for
    `single`/`ddp` with AdamW, the real torch optimizer. Engine-owned state comes from `model_state`:
    every resident line the trace does not measure (master weights, partitions, buckets, 8-bit optimizer
    state), minus unsharded weights the engine does not hold (ZeRO-3, FSDP). Quantized weights are traced
    as half-precision stand-ins and swapped for their quantized bytes. When the optimizer step itself is
    not traced, its peak is the analytic one (returned second).
    """
    prof = compute_profile(scn)
    state = model_state(scn)
    counts = param_counts(scn)
    notes: list[str] = []
    added = 0
    for key, n in state.gpu.items():
        if key not in state.traced:
            added += n
            notes.append(f"added analytically: {key} ({n / GIB:.3f} GiB)")
    if state.trace_weight_surplus:
        added -= state.trace_weight_surplus
        notes.append(
            f"unsharded weights the engine does not hold: -{state.trace_weight_surplus / GIB:.3f} GiB"
        )
    if counts.quantized and scn.strategy != "fsdp":
        half_b = DTYPE_BYTES[prof.half] if prof.half else 4
        quant_b = sum(quantized_weight_bytes(o, i, scn) for o, i in counts.quantized_linears) * counts.layers
        added += quant_b - counts.quantized * half_b
        notes.append("quantized weights: traced as half-precision stand-ins, swapped for their 4/8-bit bytes")
    step = None
    if not prof.traced_optimizer:
        step = sum(state.gpu.values()) + sum(state.window_grads.values()) + sum(state.step_temps.values())
        notes.append("optimizer step (not traceable for this engine/optimizer): analytic")
    return added, step, notes


def estimate_gib(scn: Scenario) -> float:
    """Shorthand: the tensor peak in GiB."""
    return estimate(scn).tensors_gib
