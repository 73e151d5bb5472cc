"""`zerofit plan --trace`: an exact tensor-level trace of one training step, on CPU, without a GPU or weights.

The configured model (its real transformers class, peft LoRA, checkpointing, the engine's dtypes) is built on
the meta device and materialised inside `FakeTensorMode`: tensors have shapes, dtypes and storages but no
data, so a 7B step "runs" in about a second in a few hundred MB of RAM. `MemTracker` (torch.distributed.
_tools) follows every storage through forward, backward and the optimizer step and reports the peak, split
into parameters, gradients, activations, temporaries and optimizer state.

How the step is emulated, and why (docs/platform.md, "Measuring memory without a GPU"):
  - meta build + `to_empty` inside the fake mode (real init would allocate 28 GB for a 7B model);
  - `MemTracker` is subclassed to hook only parameters that require grad (the stock one fails on frozen
    ones, which is every base weight under LoRA);
  - the second step is traced: optimizer state is created lazily by the first;
  - the engine's compute dtypes: `single`/`ddp` run under autocast (here CPU autocast standing in for CUDA's),
    DeepSpeed casts every parameter to bf16/fp16 (buffers stay fp32), FSDP2 computes in `param_dtype`;
  - LoRA dropout uses `torch.native_dropout`, whose mask is one byte per element as on CUDA (CPU's default
    dropout path keeps a mask in the input's dtype);
  - a micro-batch of more than one sequence is padded (zerofit's collate pads to the longest), so an
    attention mask is passed and attention takes the masked path (GQA keys/values repeated to all heads);
  - a preference micro-batch of m pairs is 2m rows; DPO's reference with the adapters off runs first in
    each micro-step, a no-grad forward of those rows under peft's `disable_adapter`, as the loop runs it;
  - bitsandbytes 4/8-bit matmuls cannot run on fake tensors: quantized linears are emulated by a frozen
    half-precision matmul that saves no activation (as bitsandbytes' MatMul4Bit), and their weight bytes
    are swapped for the quantized bytes analytically;
  - state the engine owns (DeepSpeed master weights and partitions, FSDP shards, bitsandbytes optimizer state,
    CPU offload) is not traceable; it is added from the analytic model's formulas and reported separately.

Only 1 and 2 decoder layers are traced; a peak is linear in the layer count, so N layers are extrapolated
as p1 + (N - 1) (p2 - p1) (docs/platform.md: exact to 0.01 GiB against a full 32-layer trace). A family that
mixes sliding-window and full-attention layers (`layer_types`: Gemma 2's 1 : 1, Gemma 3's 5 : 1) is traced
with a third model, its first layer's type followed by the other type, and each type's layers are
extrapolated by their own increment: p1 + (Na - 1) (p_aa - p1) + Nb (p_ab - p1).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerofit.core.precision import GIB
from zerofit.levers.attention import FLASH_ATTN, TORCH_VARLEN, install_kernel
from zerofit.levers.layers import decoder_layers
from zerofit.levers.recompute import enable_activation_checkpointing
from zerofit.models.lora import apply_lora, lora_config
from zerofit.models.meta import build_meta_model
from zerofit.models.vision import apply_vision_lora
from zerofit.planner.estimate import untraced_state
from zerofit.planner.images import vision_dims
from zerofit.planner.scenario import compute_profile
from zerofit.planner.shapes import model_shape, text_model
from zerofit.planner.trace_vision import traced_images
from zerofit.token_loss.fused import FUSED_LINEAR, forward_token_sum
from zerofit.token_loss.sums import token_sum_loss

if TYPE_CHECKING:
    from zerofit.planner.scenario import Scenario

# MemTracker categories, in the order reports show them.
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


@dataclass(frozen=True)
class LayerTrace:
    """Peak of one traced model (a given number of decoder layers), in bytes by MemTracker category."""

    num_layers: int
    peak_bytes: int
    by_category: dict[str, int]
    layer_types: tuple[str, ...] | None = None  # set where the family mixes attention types
    vision_depth: int | None = None  # a vision-language model's traced vision blocks

    @property
    def label(self) -> str:
        """`2`, `2 (sliding_attention, full_attention)` for a mixed pair, `2 + 1 vision block(s)`."""
        if self.vision_depth is not None:
            return f"{self.num_layers} + {self.vision_depth} vision block(s)"
        return (
            f"{self.num_layers} ({', '.join(self.layer_types)})" if self.layer_types else str(self.num_layers)
        )


@dataclass(frozen=True)
class TraceResult:
    """The traced step extrapolated to the full model, plus the untraceable engine state added analytically."""

    tensors_gib: (
        float  # traced peak (extrapolated) + engine_added_gib, comparable to MemoryEstimate.tensors_gib
    )
    traced_gib: float  # what the fake-tensor step itself peaked at, extrapolated to all layers
    engine_added_gib: float  # analytic bytes for what cannot be traced (see module docstring)
    by_category_gib: dict[str, float]
    layers: tuple[LayerTrace, ...]  # 1 and 2 layers (and the mixed pair, for mixed attention types)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for `zerofit plan --trace --json`."""
        return {
            "tensors_gib": round(self.tensors_gib, 4),
            "traced_gib": round(self.traced_gib, 4),
            "engine_added_gib": round(self.engine_added_gib, 4),
            "by_category_gib": {k: round(v, 4) for k, v in self.by_category_gib.items()},
            "layer_peaks_gib": {t.label: round(t.peak_bytes / GIB, 5) for t in self.layers},
            "notes": self.notes,
        }


def _tracker_class() -> type:
    """A MemTracker that hooks only trainable parameters (the stock one calls register_hook on frozen ones)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class TrainableOnlyMemTracker(MemTracker):  # type: ignore[misc]
        def _track_module_params_and_buffers(
            self, module: Any, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            def grad_hook(grad: Any) -> None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

            param_bytes = 0
            for param in module.parameters():
                winfos = self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
                param_bytes += sum(w.mem_consumed for w in winfos)
                if param.grad is not None:
                    self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
                hooked = self._param_to_grad_hook_handles.get(param) is not None
                if install_grad_hooks and param.requires_grad and not hooked:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)),
                    )
            buffer_bytes = 0
            for buffer in module.buffers():
                winfos = self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
                buffer_bytes += sum(w.mem_consumed for w in winfos)
            return param_bytes, buffer_bytes

    return TrainableOnlyMemTracker


def _quant_emulation_class() -> type:
    """A frozen linear standing in for a bitsandbytes 4/8-bit one: half-precision matmul, no saved input."""
    import torch

    class _FrozenMatmul(torch.autograd.Function):
        # Like bitsandbytes' MatMul4Bit: only the (frozen, quantized) weight is kept for backward.
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any) -> Any:
            ctx.save_for_backward(weight)
            return x @ weight.t()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (weight,) = ctx.saved_tensors
            return grad @ weight.to(grad.dtype), None

    class QuantLinearEmulation(torch.nn.Linear):
        compute_dtype: Any = torch.bfloat16

        def forward(self, x: Any) -> Any:
            # bitsandbytes casts the input to its compute dtype and the output back to the input's dtype.
            out = _FrozenMatmul.apply(x.to(self.compute_dtype), self.weight)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.to(x.dtype)

    return QuantLinearEmulation


def _emulate_quantization(model: Any, compute_dtype: Any, fp32_residual: bool = True) -> None:
    """Swap every decoder-layer linear for the quantized-linear emulation; upcast the rest like peft does."""
    import torch

    emu_cls = _quant_emulation_class()
    for layer in decoder_layers(text_model(model)):  # a vision-language model's tower stays unquantized
        for name, module in list(layer.named_modules()):
            if type(module) is torch.nn.Linear:
                parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
                emu = emu_cls(
                    module.in_features, module.out_features, bias=module.bias is not None, device="meta"
                )
                emu.weight = torch.nn.Parameter(module.weight.detach().to(compute_dtype), requires_grad=False)
                if module.bias is not None:
                    emu.bias = torch.nn.Parameter(module.bias.detach().to(torch.float32), requires_grad=False)
                emu.compute_dtype = compute_dtype
                setattr(parent, name.rpartition(".")[2], emu)
    # prepare_model_for_kbit_training: freeze everything, cast every non-quantized half parameter to fp32
    # (unless quantization.fp32_residual is false: they stay in the compute dtype).
    quantized = {id(m.weight) for m in model.modules() if isinstance(m, emu_cls)}
    for param in model.parameters():
        param.requires_grad_(False)
        if not fp32_residual:
            if id(param) not in quantized and param.dtype.is_floating_point:
                param.data = param.data.to(compute_dtype)
        elif id(param) not in quantized and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)


def _cuda_like_dropout(model: Any) -> None:
    """LoRA dropout with a one-byte mask, as CUDA's fused dropout keeps (CPU's keeps one in the input dtype)."""
    import torch

    class NativeDropout(torch.nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, x: Any) -> Any:
            return torch.native_dropout(x, self.p, self.training)[0]

    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            for key, drop in list(dropouts.items()):
                if isinstance(drop, torch.nn.Dropout) and drop.p > 0:
                    dropouts[key] = NativeDropout(drop.p)


@contextlib.contextmanager
def _masks_as_on_device(documents_found: bool = False) -> Any:
    """Let transformers skip the causal mask for an unpadded batch, as it does for real tensors.

    transformers treats fake tensors as "tracing" and then always materialises the causal mask, which
    sdpa would convert and save in every layer; on a device an unpadded batch runs mask-free (is_causal).
    It also cannot rule out packed sequences from fake position ids. A padded batch (a real mask tensor with a zero) still takes the original, masked path.
    """
    from unittest import mock

    import transformers.masking_utils as masking

    original = masking._ignore_causal_mask_sdpa

    def ignore_when_unpadded(
        padding_mask: Any, q_length: int, kv_length: int, *args: Any, **kwargs: Any
    ) -> bool:
        local = kwargs.get("local_attention_size", args[2] if len(args) > 2 else None)
        if padding_mask is None and (local is None or kv_length < local) and q_length == kv_length:
            return True
        return original(padding_mask, q_length, kv_length, *args, **kwargs)

    # zerofit never packs several examples into a row; transformers cannot tell from fake position ids.
    # The varlen path (model.attn_implementation=varlen) gets one document per row where the run finds
    # documents (`documents_found`: packed rows, padded micro-batches of several sequences), and the planned
    # kernel as on the GPU (torch's varlen op has a fake implementation saving what the CUDA kernel saves).
    import zerofit.levers.attention as attention

    def documents(batch_size: int, seq_len: int, *args: Any) -> Any:
        return attention.uniform_documents(batch_size, seq_len) if documents_found else None

    with (
        mock.patch.object(masking, "_ignore_causal_mask_sdpa", ignore_when_unpadded),
        mock.patch.object(masking, "find_packed_sequence_indices", lambda *args, **kwargs: None),
        mock.patch.object(attention, "_documents", documents),
        mock.patch.object(attention, "_runnable", lambda kernel, query: kernel),
    ):
        yield


def build_traced_model(
    scn: Scenario,
    num_layers: int,
    layer_types: tuple[str, ...] | None = None,
    vision_depth: int | None = None,
) -> Any:
    """The configured model with `num_layers` decoder layers (of `layer_types`, where given; a vision-language
    model: `vision_depth` vision blocks), on the meta device, in the engine's dtypes."""
    import torch

    prof = compute_profile(scn)
    model = build_meta_model(
        scn.model,
        num_layers=num_layers,
        attn_implementation=scn.attn_implementation,
        dtype=prof.load_dtype,
        layer_types=layer_types,
        vision_depth=vision_depth,
    )
    if scn.quantization != "none":
        _emulate_quantization(model, prof.half_dtype or torch.float32, scn.fp32_residual)
    if scn.lora and model_shape(scn.model).is_vision:  # adapters where the run puts them (`models.vision`)
        spec = lora_config(scn.lora_r, scn.lora_alpha, scn.lora_dropout, scn.lora_targets, scn.use_dora)
        model = apply_vision_lora(model, spec, scn.lora_projector, scn.lora_vision_tower, None)[0]
        _cuda_like_dropout(model)
    elif scn.lora:
        model = apply_lora(
            model,
            lora_config(
                scn.lora_r,
                scn.lora_alpha,
                scn.lora_dropout,
                scn.lora_targets,
                scn.use_dora,
                scn.lora_moe_experts,
                scn.lora_train_router,
            ),
        )
        _cuda_like_dropout(model)
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    # The traced model has 1 or 2 layers: checkpointing is traced as all or none (see `trace_memory`).
    all_layers = scn.checkpointed(model_shape(scn.model).num_layers) == model_shape(scn.model).num_layers
    # The run checkpoints every block it finds, a vision-language model's vision blocks too.
    n_ckpt = enable_activation_checkpointing(hf, len(decoder_layers(hf)) if all_layers else 0)
    _enable_levers(hf, scn, n_ckpt)
    if scn.varlen_kernel is not None:
        # FlashAttention-2 saves what torch's varlen (a FlashAttention-2 kernel) does; only the latter has
        # a fake implementation to trace.
        install_kernel(hf, TORCH_VARLEN if scn.varlen_kernel == FLASH_ATTN else scn.varlen_kernel)
    hf.config.use_cache = False
    if prof.cast_params_to is not None:
        # DeepSpeed / FSDP2 compute with every parameter in the half dtype (buffers stay fp32).
        for param in model.parameters():
            if param.dtype.is_floating_point:
                param.data = param.data.to(prof.cast_dtype)
    model.train()
    return model


def _meta_offload_class() -> type:
    """`ActivationOffload` whose host copy is a meta tensor: on the traced (CPU) device an offloaded input
    must leave the device's count, as it leaves the GPU's in a run."""
    import torch

    from zerofit.levers.offload import ActivationOffload, _Offloaded

    class MetaOffload(ActivationOffload):
        def pack(self, tensor: torch.Tensor) -> Any:
            if isinstance(tensor, torch.nn.Parameter):
                return tensor
            return _Offloaded(torch.empty_like(tensor, device="meta"), tensor.device, None)

        def unpack(self, packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            return torch.empty_like(packed.host, device=packed.device)  # the prefetched copy

    return MetaOffload


def _enable_levers(hf: Any, scn: Scenario, n_ckpt: int) -> None:
    """The long-context levers as `model.enable_memory_levers` turns them on: the tiled MLP, the lean
    RMSNorms, activation offload of the checkpointed layers' inputs, the fused loss's head."""
    from zerofit.levers.norms import enable_lean_norm
    from zerofit.levers.offload import enable_activation_offload
    from zerofit.levers.tiling import enable_tiled_mlp
    from zerofit.token_loss.fused import install_fused_head

    layers = decoder_layers(hf)
    enable_tiled_mlp(layers, scn.tiled_mlp if scn.tiled_mlp > 1 else 0)
    if scn.lean_norm:
        enable_lean_norm(hf)
    if scn.activation_offload and n_ckpt:
        enable_activation_offload(layers[:n_ckpt], _meta_offload_class()())
    if scn.cross_entropy == "fused_linear":
        install_fused_head(hf)


def _trace_layers(
    scn: Scenario,
    num_layers: int,
    layer_types: tuple[str, ...] | None = None,
    vision_depth: int | None = None,
) -> LayerTrace:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    prof = compute_profile(scn)
    model = build_traced_model(scn, num_layers, layer_types, vision_depth)
    autocast = torch.autocast("cpu", dtype=prof.half_dtype) if prof.autocast else contextlib.nullcontext()
    micro, seq = scn.rows, scn.seq_len  # a preference micro-batch: both sequences of every pair
    mask = _padding_mask(micro, seq)

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    fed = traced_images(model, scn, fake, micro, seq)  # a vision-language model's images (else none)
    with fake, _masks_as_on_device(scn.masked_attention), fed as images:
        _materialize(model, scn)
        trainable, optimizer = _trainable_and_optimizer(model, prof)
        input_ids = torch.zeros(micro, seq, dtype=torch.long)
        labels = torch.zeros(micro, seq, dtype=torch.long)

        def micro_step(tracker: Any = None) -> None:
            inputs = {"input_ids": input_ids, "attention_mask": mask, **images}
            if scn.reference_forward:  # DPO's reference: the same rows, adapters off, no grad, first
                _reference_forward(model, inputs, labels, scn.cross_entropy, autocast, tracker)
            with autocast:
                if scn.cross_entropy == FUSED_LINEAR:  # the loss inside lm_head: no logits at all
                    loss = forward_token_sum(model, inputs, labels, scn.cross_entropy)
                else:  # the logits held through backward, as the analytic model counts them
                    logits = model(**inputs, use_cache=False).logits
                    loss = token_sum_loss(logits, labels, scn.cross_entropy)
            loss.backward()

        def window(tracker: Any = None) -> None:
            # Two micro-steps stand for any window of >= 2: from the second on, gradients are held in forward.
            for i in range(min(scn.grad_accum_steps, 2)):
                if tracker is not None and i > 0:
                    tracker.reset_mod_stats()  # per-module stats only; the global peak is kept
                micro_step(tracker)
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                for p in trainable:
                    p.grad = None

        window()  # the first step creates the optimizer state; the second is the one measured
        tracker = _tracker_class()()
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        with tracker, warnings.catch_warnings():
            # Gradients the engine takes over are dropped before the tracker's own hook sees them.
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            window(tracker)
        peak = tracker.get_tracker_snapshot("peak")
    total, by_cat = _peak_by_category(peak)
    return LayerTrace(num_layers, total, by_cat, layer_types, vision_depth)


def _trainable_and_optimizer(model: Any, prof: Any) -> tuple[list[Any], Any]:
    """The traced model's trainable parameters and, where the trace runs it, torch's AdamW over them."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    if prof.grads_leave_autograd:
        # ZeRO-2/3 and FSDP-with-sync move each gradient into the engine's own partitioned buffers as
        # soon as it is accumulated; those buffers are added analytically, so autograd's copy is dropped.
        for p in trainable:
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    if not prof.traced_optimizer:
        return trainable, None
    # foreach=True: what torch picks by default for CUDA tensors (CPU would default to the for-loop).
    return trainable, torch.optim.AdamW(trainable, lr=1e-4, foreach=True)


def _materialize(model: Any, scn: Scenario) -> None:
    """Fake storages for the meta model. `to_empty` gives each module its own new parameter, which unties
    a tied lm_head (Gemma, small Qwens): one weight would be traced as two. Tie it back as transformers
    loads it."""
    model.to_empty(device="cpu")
    if not model_shape(scn.model).tie_word_embeddings:
        return
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = hf.get_output_embeddings()
    head = getattr(head, "base_layer", head)  # an adapter on lm_head wraps the tied linear
    head.weight = hf.get_input_embeddings().weight


def _reference_forward(
    model: Any, inputs: dict[str, Any], labels: Any, impl: str, autocast: Any, tracker: Any
) -> None:
    """DPO's adapters-off reference as the loop runs it: a no-grad forward of the rows with peft's
    adapters disabled, its log-prob sums (`preference.reference: adapters_off`)."""
    import torch

    with autocast, torch.no_grad(), model.disable_adapter():
        forward_token_sum(model, inputs, labels, impl)
    if tracker is not None:
        tracker.reset_mod_stats()  # the modules run again: per-module stats only, the peak is kept


def _padding_mask(micro: int, seq: int) -> Any:
    """A padded micro-batch (more than one sequence) carries a real mask with one padded position, so
    transformers takes the masked attention path exactly as it would for zerofit's right-padded batches."""
    import torch

    if micro == 1:
        return None
    mask = torch.ones(micro, seq, dtype=torch.long)
    mask[-1, -1] = 0
    return mask


def _peak_by_category(peak: dict[Any, dict[Any, int]]) -> tuple[int, dict[str, int]]:
    """The memory tracker's peak snapshot summed over devices: (total bytes, bytes by category)."""
    by_cat = dict.fromkeys(CATEGORIES, 0)
    total = 0
    for device, snap in peak.items():
        if getattr(device, "type", str(device)) == "meta":
            continue  # offloaded inputs' host stand-ins (`_meta_offload_class`), not device memory
        for key, value in snap.items():
            name = getattr(key, "value", str(key))
            if name == "Total":
                total += value
            else:
                by_cat[name] = by_cat.get(name, 0) + value
    return total, by_cat


def trace_memory(scn: Scenario) -> TraceResult:
    """Trace the configured step with 1 and 2 decoder layers (and a mixed pair where the family mixes
    attention types) and extrapolate to the model's layer count.

    Checkpointing is traced as all layers or none: a peak with the first n of L layers checkpointed is not
    linear in the layer count, so a selective plan raises ValueError (the analytic model covers it).
    """
    n = model_shape(scn.model).num_layers
    if 0 < scn.checkpointed(n) < n:
        raise ValueError(
            f"the trace covers activation checkpointing of all layers or none, not the first {scn.checkpointed(n)} "
            f"of {n}; trace with train.activation_checkpointing=true or false"
        )
    traces, counts = _traces_by_layer_type(scn, n)
    traced = _extrapolate([t.peak_bytes for t in traces], counts)
    by_cat = {k: _extrapolate([t.by_category.get(k, 0) for t in traces], counts) / GIB for k in CATEGORIES}
    added, step_peak, notes = untraced_state(scn)
    total = max(traced + added, step_peak or 0)
    return TraceResult(
        tensors_gib=total / GIB,
        traced_gib=traced / GIB,
        engine_added_gib=added / GIB,
        by_category_gib=by_cat,
        layers=traces,
        notes=notes,
    )


def _extrapolate(values: list[int], counts: tuple[int, ...]) -> int:
    """The 1-layer value plus each later trace's increment over it, times the layers it stands for."""
    return values[0] + sum(c * (v - values[0]) for v, c in zip(values[1:], counts, strict=True))


def _traces_by_layer_type(scn: Scenario, n: int) -> tuple[tuple[LayerTrace, ...], tuple[int, ...]]:
    """The traced models and how many of the N layers each one's increment over the 1-layer trace stands
    for: (1 layer, 2 layers) and (N - 1,) for one attention type; for a family mixing sliding and full
    layers (`layer_types`), also the first layer's type followed by the other one, so that each type's
    layers count their own increment (a sliding layer's saved window mask, which a full layer lacks)."""
    from zerofit.models.meta import hf_config

    types = tuple(getattr(hf_config(scn.model), "layer_types", None) or ())
    dims = vision_dims(scn.model)
    if dims is not None:  # a vision-language model: its vision blocks' increment too
        traces = (
            _trace_layers(scn, 1, None, 1),
            _trace_layers(scn, 2, None, 1),
            _trace_layers(scn, 1, None, 2),
        )
        return traces, (n - 1, dims.depth - 1)
    if len(set(types)) < 2:
        return (_trace_layers(scn, 1), _trace_layers(scn, 2)), (n - 1,)
    first = types[0]
    other = next(t for t in types if t != first)
    traces = (
        _trace_layers(scn, 1, (first,)),
        _trace_layers(scn, 2, (first, first)),
        _trace_layers(scn, 2, (first, other)),
    )
    return traces, (types.count(first) - 1, len(types) - types.count(first))
