"""The loss that never builds the logits (`train.cross_entropy: fused_linear`).

The same token sum as `zerofit.token_loss.sums` (next-token cross-entropy over valid labels, fp32), computed from the
final hidden states and the lm_head weight chunk by chunk of tokens: per chunk, matmul -> fp32
log-sum-exp -> loss; neither the [tokens x vocab] logits nor their gradient ever exist in full.

    forward   per chunk of `chunk_tokens(vocab)` tokens: logits = hidden_c @ W^T (+ b) in the compute dtype,
              fp32 log-sum-exp and target logit -> the sum; keeps one fp32 log-sum-exp per token.
    backward  per chunk again: recompute the chunk's logits, (softmax - one_hot) x the incoming scale in
              fp32, cast to the compute dtype (the dtype the reference's logits gradient has), then
              grad_hidden_c = G_c @ W and grad_W += G_c^T @ hidden_c (accumulated in fp32).

Recomputing in backward (instead of computing the gradients in forward, as Liger does) costs one more
[tokens x hidden x vocab] matmul (about 2% of an 8B step's FLOPs at a 128k vocabulary) and buys: nothing
but the per-token log-sum-exp is held between forward and backward; a frozen head (LoRA, QLoRA: the
long-context case) never allocates a weight gradient; evaluation (no_grad) does no gradient work at all;
and the incoming gradient (1 / global tokens x the engine's factor) scales each chunk exactly as the
chunked loss does.

How the model hands over its hidden states without breaking the engines: `install_fused_head` replaces
the lm_head *instance's* `forward` (the module, its class and `lm_head.weight` stay, so checkpoints, export
and peft see nothing new). Inside `fused_targets(model, labels)` that forward returns the loss sum instead
of logits, so the loss is computed inside the lm_head module's forward: DeepSpeed ZeRO-3 has gathered the
weight in its forward pre-hook, FSDP2 has unsharded the root; the loss flows out through the module's
output, so ZeRO-3's backward pre-hook re-gathers the weight before this backward runs. Outside the context
(generation, export, any plain forward) the head computes logits exactly as before.
`forward_token_sum` is the one entry point of the train step and the evaluation for every
`train.cross_entropy`.

Architectures that change the logits after lm_head (Gemma 2/3's final logit softcapping, Cohere's
logit_scale, Granite's logits_scaling) are refused: the loss would run before that change. A model whose
forward does anything to lm_head's output is caught at the first forward (the output no longer shares the
returned loss's storage).

Memory (pure PyTorch; N tokens, V vocabulary, H hidden, C = min(N, `chunk_tokens(V)`): C x V x 4 bytes is
128 MiB; d = bytes of the compute dtype, dh / dw of the hidden states / the weight):
    held forward -> backward: 12 N (fp32 log-sum-exp + int64 targets) besides the hidden states and the
        weight (the lm_head input and parameter, held by any loss). The logits (N V d) and, in backward,
        their gradient (N V d) of the chunked loss do not exist.
    forward, transient: C V 8 at most (one chunk at a time: its logits and their fp32 upcast, then the
        fp32 logits and logsumexp's temporary), plus V H d for the weight cast once when dw != d
        (autocast over an fp32 head: QLoRA), as autocast's own cast of it costs.
    backward, transient: C V (4 + d) (the chunk's recomputed logits and their fp32 gradient, then that
        gradient in the compute dtype; fp32: C V 8), the same V H d weight cast when dw != d, the
        hidden-state gradient N H dh (what lm_head's backward produces anyway), and for a trainable head
        an fp32 weight-gradient accumulator V H 4 (+ V H d per chunk when d != 4) and its cast to the
        weight's dtype V H dw (none when dw = 4).
    Measured (benchmarks/loss_memory.py, CPU fp32, N 8,192, V 32,000, H 256, trainable head): 334 MiB
    at the peak (C V 8 = 256 MiB, V H 4 = 31 MiB, N H 4 = 8 MiB, the rest per-token), against 2,295 MiB
    for the chunked loss (N V 4 logits + N V 4 gradient + one chunk) and 3,038 MiB unchunked.

On CUDA, with grad enabled and no autocast in between, Liger-Kernel's fused linear cross-entropy (or
Apple's cut-cross-entropy, gradient filtering off) does the chunk math when installed; the same sums.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from zerofit.core.errors import ConfigError
from zerofit.token_loss.sums import IGNORE_INDEX, chunk_tokens, shifted_targets, token_losses, token_sum_loss

__all__ = [
    "FUSED_LINEAR",
    "FusedHead",
    "describe_fused",
    "forward_token_losses",
    "forward_token_sum",
    "fused_kernel",
    "fused_linear_token_sum",
    "fused_targets",
    "install_fused_head",
    "logit_postprocessing",
]

FUSED_LINEAR = "fused_linear"
# The optional CUDA kernels, in order of preference: (name, module to import).
_KERNELS = (("liger", "liger_kernel.transformers"), ("cut_cross_entropy", "cut_cross_entropy"))
_STATE = "zerofit_fused_head"  # the attribute of the lm_head instance that holds its `FusedHead`
# Config attributes through which an architecture changes the logits after lm_head, and their no-op value.
_LOGIT_POSTPROCESSING = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": None}


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype lm_head's matmul runs in here: autocast's where it is on for this device (it casts both
    operands), else the promotion of the two dtypes (what F.linear would refuse or produce)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _FusedLinearCrossEntropySum(torch.autograd.Function):
    """Sum of cross-entropy of (hidden @ W^T + b) over valid targets, chunk by chunk (module docstring);
    `per_token`: the per-token cross-entropy instead (0 at invalid targets; the incoming gradient is then
    one number per token, for preference objectives' per-row sums)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        per_token: bool = False,
    ) -> torch.Tensor:
        cdt = _compute_dtype(hidden, weight)
        acc = torch.promote_types(cdt, torch.float32)  # fp32 (fp64 only for a float64 gradcheck)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        tokens = torch.empty(n if per_token else 0, dtype=acc, device=hidden.device)
        # Autocast off inside: the casts are explicit (once per weight, not once per chunk).
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
            for start in range(0, n, chunk):
                x = F.linear(hidden[start : start + chunk].to(cdt), w, b).to(acc)
                t = targets[start : start + chunk]
                lse_c = torch.logsumexp(x, dim=-1)
                picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                if per_token:
                    tokens[start : start + chunk] = torch.where(t != IGNORE_INDEX, lse_c - picked, 0.0)
                else:
                    total += torch.where(t != IGNORE_INDEX, lse_c - picked, 0.0).sum()
                lse[start : start + chunk] = lse_c
                del x  # before the next chunk's matmul: one chunk of logits at a time, not two
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.cdt = chunk, cdt
        return tokens if per_token else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdt, chunk, acc = ctx.cdt, ctx.chunk, lse.dtype
        scale = grad_out.to(acc)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
            for start in range(0, hidden.shape[0], chunk):
                stop = start + chunk
                h, t = hidden[start:stop].to(cdt), targets[start:stop]
                # softmax - one_hot(target), for valid rows only, times the incoming gradient (fp32).
                g = torch.sub(F.linear(h, w, b), lse[start:stop, None]).exp_()
                g.scatter_add_(1, t.clamp(min=0).unsqueeze(1), torch.full_like(lse[start:stop, None], -1.0))
                s = scale if scale.dim() == 0 else scale[start:stop]  # per-token: this chunk's slice
                g.mul_(((t != IGNORE_INDEX).to(acc) * s).unsqueeze(1))
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(cdt)  # the reference's logits gradient is in the logits' dtype
                if need_h:
                    grad_h[start:stop] = g @ w
                if need_w and grad_w.dtype == cdt:
                    grad_w.addmm_(g.t(), h)  # in place: no [vocab x hidden] temporary per chunk
                elif need_w:
                    grad_w += g.t() @ h  # a half matmul, summed over chunks in fp32
                del g  # before the next chunk's matmul
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None and bias is not None else None
        return grad_h, grad_w, grad_b, None, None, None


def fused_kernel(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """Which code does the chunk math for these operands: `liger`, `cut_cross_entropy` or `pytorch`.

    A kernel only on CUDA, with gradients on (evaluation keeps the pure-PyTorch forward: no gradient
    work) and operands already in one dtype with autocast off (so the kernel sees the reference's dtype).
    """
    device = hidden.device.type
    usable = device == "cuda" and torch.is_grad_enabled() and hidden.dtype == weight.dtype
    if not usable or torch.is_autocast_enabled(device):
        return "pytorch"
    return next((name for name, module in _KERNELS if _importable(module)), "pytorch")


def describe_fused(vocab_size: int, device_type: str) -> str:
    """The plan's words for the fused loss on this device (`zerofit.recipe.run.describe_compute`)."""
    kernel = next((n for n, m in _KERNELS if _importable(m)), None) if device_type == "cuda" else None
    how = f"{kernel}'s kernel where hidden states and weight share a dtype" if kernel else "pure PyTorch"
    return (
        f"inside lm_head, chunks of up to {chunk_tokens(vocab_size):,} tokens, {how}: the logits never exist"
    )


@functools.cache
def _importable(module: str) -> bool:
    """Whether `module` imports (asked once per process: a failed import is not cached by Python)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _kernel_token_sum(
    kernel: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """The token sum through an installed CUDA kernel (`fused_kernel`); reduction sum, fp32."""
    if kernel == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
        return loss(weight, hidden, targets, bias).float()
    from cut_cross_entropy import linear_cross_entropy

    # filter_eps=None: no gradient filtering (the default skips small softmax entries: not exact).
    kwargs = {} if bias is None else {"bias": bias}
    out = linear_cross_entropy(
        hidden, weight, targets, ignore_index=IGNORE_INDEX, reduction="sum", filter_eps=None, **kwargs
    )
    return out.float()


def fused_linear_token_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int | None = None,
    per_token: bool = False,
) -> torch.Tensor:
    """Sum over valid `targets` of the cross-entropy of `hidden @ weight^T + bias`, in fp32, without the
    logits: `hidden` [..., H] (flattened to tokens), `targets` [tokens] already shifted
    (`zerofit.token_loss.sums.shifted_targets`), `chunk` tokens at a time (default `chunk_tokens(vocab)`).
    `per_token`: the [tokens] cross-entropies instead of their sum (pure PyTorch: the kernels only sum)."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # a view: the final norm's output is contiguous
    targets = targets.to(flat.device)
    if flat.shape[0] != targets.shape[0]:
        raise ValueError(f"{flat.shape[0]} hidden states for {targets.shape[0]} targets")
    kernel = "pytorch" if per_token else fused_kernel(flat, weight)
    if kernel != "pytorch":
        return _kernel_token_sum(kernel, flat, weight, bias, targets)
    return _FusedLinearCrossEntropySum.apply(
        flat, weight, bias, targets, chunk or chunk_tokens(weight.shape[0]), per_token
    )


@dataclass
class FusedHead:
    """The fused lm_head's state: the targets of the forward about to run (None: a plain head) and the
    loss it returned (to check that the model handed it back untouched)."""

    chunk: int | None = None
    targets: torch.Tensor | None = None
    returned: torch.Tensor | None = None
    per_token: bool = False  # the next forward returns per-token losses, not their sum

    def loss_from(self, output: torch.Tensor) -> torch.Tensor:
        """The loss sum from the model's `logits` output, refusing a model that changed it after lm_head.

        Engine hooks may wrap the output (ZeRO-3 hands back a `detach()`-ed alias), which keeps its storage;
        any computation on it (a softcap, a scale) would not.
        """
        returned = self.returned
        if returned is None:
            raise ValueError("the fused lm_head did not run in this forward (the model never called it)")
        if output.shape == returned.shape and output.data_ptr() == returned.data_ptr():
            return output
        if _is_cast_of(output, returned):
            # FSDP2's MixedPrecisionPolicy.output_dtype casts the root's output (bf16 here) after it
            # registered its pre-backward hook on the fp32 sum itself: that sum is the loss, hook included.
            return returned
        raise ConfigError([_postprocessing_problem("its forward changes lm_head's output")])


def _is_cast_of(output: torch.Tensor, returned: torch.Tensor) -> bool:
    """Whether `output` is only a dtype cast of `returned` (an engine's output cast, nothing else): the
    cast is the last op in the graph; without a graph (evaluation) its value is the cast's."""
    if output.shape != returned.shape or output.dtype == returned.dtype:
        return False
    node = output.grad_fn
    if node is not None:
        return type(node).__name__ == "ToCopyBackward0" and node.next_functions[0][0] is returned.grad_fn
    return torch.equal(output, returned.to(output.dtype))


def logit_postprocessing(config: dict[str, Any]) -> str | None:
    """`config.<key> = <value>` for the first config.json attribute through which the architecture changes
    the logits after lm_head (a softcap, a scale), else None: the fused loss would miss that change."""
    for key, neutral in _LOGIT_POSTPROCESSING.items():
        value = config.get(key, neutral)
        if value not in (neutral, 1, 1.0):
            return f"config.{key} = {value}"
    return None


def _postprocessing_problem(what: str) -> str:
    return (
        f"train.cross_entropy = 'fused_linear' computes the loss inside lm_head, and this model changes the "
        f"logits after lm_head ({what}), so the loss would miss that change; use train.cross_entropy=chunked "
        "(the same token sums from the model's own logits, in chunks)"
    )


def _fused_head_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """lm_head's forward: the loss sum inside `fused_targets`, else the class's own forward (logits)."""
    state: FusedHead = self.__dict__[_STATE]
    if state.targets is None:
        return type(self).forward(self, hidden)  # type(self): FSDP2 swaps the class, keeping Linear's forward
    targets, state.targets = state.targets, None  # one forward per context
    state.returned = fused_linear_token_sum(
        hidden, self.weight, self.bias, targets, state.chunk, state.per_token
    )
    return state.returned


def install_fused_head(model: torch.nn.Module, chunk: int | None = None) -> None:
    """Make the transformers model `model`'s lm_head able to compute the fused loss (module docstring).

    Refuses (ConfigError) an lm_head that is not a plain `nn.Linear` (a LoRA-wrapped or quantized head) and
    an architecture that changes the logits after lm_head.
    """
    config = getattr(model, "config", None)
    changed = logit_postprocessing({key: getattr(config, key, None) for key in _LOGIT_POSTPROCESSING})
    if changed is not None:
        raise ConfigError([_postprocessing_problem(changed)])
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ConfigError(
            [
                f"train.cross_entropy = 'fused_linear' needs the model's lm_head to be a plain Linear layer, and "
                f"it is a {type(head).__module__}.{type(head).__qualname__} (a LoRA-adapted or quantized "
                "head); leave lm_head out of "
                "lora.target_modules, or use train.cross_entropy=chunked"
            ]
        )
    setattr(head, _STATE, FusedHead(chunk=chunk))
    head.forward = types.MethodType(_fused_head_forward, head)


def _fused_state(model: torch.nn.Module) -> FusedHead:
    """The `FusedHead` under `model` (through engine and peft wrappers)."""
    for module in model.modules():
        state = module.__dict__.get(_STATE)
        if isinstance(state, FusedHead):
            return state
    raise ValueError("train.cross_entropy=fused_linear on a model whose lm_head was not installed for it")


@contextmanager
def fused_targets(
    model: torch.nn.Module, labels: torch.Tensor, per_token: bool = False, shifted: bool = False
) -> Iterator[FusedHead]:
    """Within it, the next forward of `model`'s fused lm_head returns the token-sum loss of `labels`
    (unshifted, HF-style, unless `shifted`) instead of logits (`per_token`: the per-token losses, flattened)."""
    state = _fused_state(model)
    targets = shifted_targets(labels, shifted)
    state.targets, state.returned, state.per_token = targets, None, per_token
    try:
        yield state
    finally:
        state.targets = state.returned = None
        state.per_token = False


def forward_token_sum(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor],
    labels: torch.Tensor,
    impl: str,
    shifted: bool = False,
) -> torch.Tensor:
    """One forward of `model` on `inputs` and its token-sum loss over `labels` (`zerofit.token_loss.sums`), by
    `train.cross_entropy`: `fused_linear` inside lm_head (no logits), anything else from the logits
    (`shifted`: a sequence-parallel shard's targets, `zerofit.token_loss.sums.batch_labels`)."""
    if impl != FUSED_LINEAR:
        return token_sum_loss(model(**inputs, use_cache=False).logits, labels, impl, shifted)
    with fused_targets(model, labels, shifted=shifted) as head:
        return head.loss_from(model(**inputs, use_cache=False).logits)


def forward_token_losses(
    model: torch.nn.Module, inputs: Mapping[str, torch.Tensor], labels: torch.Tensor, impl: str
) -> torch.Tensor:
    """One forward of `model` on `inputs` and its per-token losses over `labels`, [rows, seq] fp32
    (`zerofit.token_loss.sums.token_losses`): `fused_linear` inside lm_head (no logits), anything else from the
    logits in chunks (`unchunked`: in one piece)."""
    if impl != FUSED_LINEAR:
        return token_losses(model(**inputs, use_cache=False).logits, labels, impl)
    with fused_targets(model, labels, per_token=True) as head:
        return head.loss_from(model(**inputs, use_cache=False).logits).reshape(labels.shape)
