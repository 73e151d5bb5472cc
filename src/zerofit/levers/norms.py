"""Lean RMSNorm (`train.lean_norm`): the model's RMSNorms save their input as it is, not its fp32 upcast.

Hugging Face's Llama / Mistral / Qwen2 / Qwen3 RMSNorm computes

    xf = x.to(fp32); rstd = rsqrt(mean(xf^2) + eps); y = weight * (xf * rstd).to(x.dtype)

and autograd keeps `xf` (4 bytes per element: twice a bf16 input) and `rstd` for backward, and the
normalized output too when the weight trains. At long context that is one of the largest saved terms of a
LoRA layer (2 norms x 4 x hidden bytes per token, more than sdpa attention saves at the Llama-3 shape). `_LeanRMSNorm` runs exactly those ops in
forward, so its output is bit-identical to HF's, but saves only `x` in its own dtype and the fp32 `rstd`
per token; backward recomputes `xf * rstd` (fp32) and applies RMSNorm's gradient:

    g = (dy * weight).to(x.dtype).to(fp32)                    (the casts autograd's chain would make)
    dx = rstd * g - xf * rstd^3 * mean(g * xf)                 (in fp32, cast to x.dtype)
    dweight = sum over tokens of dy * (xf * rstd).to(x.dtype)  (summed in fp32, cast to weight's dtype)

token chunk by token chunk (`BACKWARD_CHUNK_ELEMENTS`), so its fp32 temporaries are small at any length.

Exact up to rounding: the gradient formula is the chain rule of the same ops, evaluated in one fp32
expression instead of autograd's node-by-node order; tests/unit/levers/test_norms.py holds it to 1e-5 of the
gradient's largest magnitude in fp32. Saved bytes per token and norm: dtype(x) x hidden + 4 instead of 4 x hidden + 4 (+ dtype x
hidden with a trainable weight); with an fp32 residual stream (fp32 training, QLoRA's
`quantization.fp32_residual`) HF's upcast is the input itself, so only full fine-tuning's normalized output
is saved less. Cost: one elementwise recompute of the normalized value per norm in backward.

Which norms: every module whose class is one of `KNOWN_RMSNORMS` (same forward, checked by a test against
each class). Another class whose name ends in `RMSNorm` (Gemma's `(1 + weight)` in fp32, Cohere's, ...) is
refused with a `ConfigError`, never computed with the wrong formula. The module is kept (names, hooks:
ZeRO-3 gathers its weight before the call, FSDP2 at the decoder layer); only its `forward` is replaced on
the instance, and the weight is an input of the function, so its gradient arrives once per backward as the
engines' hooks expect. Inside checkpointed layers the function is simply rerun by the recomputation.
"""

from __future__ import annotations

from typing import Any

import torch

from zerofit.core.errors import ConfigError

__all__ = ["KNOWN_RMSNORMS", "LEAN_NORM_MODEL_TYPES", "check_lean_norm", "enable_lean_norm", "lean_rms_norm"]

# Classes whose forward is HF's Llama formula (weight * normalized.to(input dtype), eps in
# `variance_epsilon`). Qwen3's q_norm / k_norm (per head) are Qwen3RMSNorm too.
KNOWN_RMSNORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
# The transformers model types whose every RMSNorm is one of those: where `train.lean_norm = auto` may
# turn it on (the planner reads the model type from config.json, before any module exists).
LEAN_NORM_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class _LeanRMSNorm(torch.autograd.Function):
    """HF's RMSNorm forward; saves x (its dtype) and the fp32 rstd, recomputes the rest in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, chunk_elements: int
    ) -> torch.Tensor:
        # The very ops of LlamaRMSNorm.forward, in its order (bit-identical output).
        xf = x.to(torch.float32)
        variance = xf.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        out = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.rows = max(1, chunk_elements // x.shape[-1])
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        h = x.shape[-1]
        flat_x, flat_dy, flat_r = x.reshape(-1, h), grad_out.reshape(-1, h), rstd.reshape(-1, 1)
        grad_x = torch.empty_like(flat_x) if need_x else None
        grad_w = torch.zeros(h, dtype=torch.float32, device=x.device) if need_w else None
        # Token chunks: the fp32 temporaries (the recomputed normalized value, the gradient's terms) exist
        # for `rows` tokens at a time, not for the whole sequence (several fp32 copies of it at 32k tokens).
        for start in range(0, flat_x.shape[0], ctx.rows):
            rows = slice(start, start + ctx.rows)
            xf, r, dy = flat_x[rows].to(torch.float32), flat_r[rows], flat_dy[rows]
            if grad_w is not None:
                grad_w += (dy * (xf * r).to(x.dtype)).sum(0, dtype=torch.float32)
            if grad_x is not None:
                g = (dy * weight).to(x.dtype).to(torch.float32)  # the casts autograd's chain makes
                dot = (g * xf).mean(-1, keepdim=True)
                grad_x[rows] = (r * g - xf * (r.pow(3) * dot)).to(x.dtype)
        dx = grad_x.view_as(x) if grad_x is not None else None
        return dx, grad_w.to(weight.dtype) if grad_w is not None else None, None, None


# Backward's fp32 temporaries are this many elements at a time (16 MiB each; 1,024 tokens at hidden 4,096).
BACKWARD_CHUNK_ELEMENTS = 1 << 22


def lean_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, chunk_elements: int = BACKWARD_CHUNK_ELEMENTS
) -> torch.Tensor:
    """RMSNorm of `x` (last axis) times `weight`, as HF's Llama RMSNorm, saving only x and rstd; backward
    works through `chunk_elements` elements of tokens at a time."""
    return _LeanRMSNorm.apply(x, weight, eps, chunk_elements)  # type: ignore[no-any-return]


def check_lean_norm(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's RMSNorm modules (class name ending in `RMSNorm`); refuses a class not known to compute
    HF's Llama formula (the module docstring). A meta-device build of the model will do (no weights)."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    unknown = sorted({type(m).__name__ for m in norms} - KNOWN_RMSNORMS)
    if unknown:
        raise ConfigError(
            [
                f"train.lean_norm = true: this model's norm class {', '.join(unknown)} is not one whose "
                f"forward zerofit knows ({', '.join(sorted(KNOWN_RMSNORMS))}: weight x the fp32 "
                "normalized input cast back), so its lean recomputation could compute something else "
                "(Gemma's RMSNorm multiplies by 1 + weight in fp32, for one); set train.lean_norm=false "
                "for this model."
            ]
        )
    return norms


def enable_lean_norm(model: torch.nn.Module) -> int:
    """Replace the forward of every RMSNorm in `model` by `lean_rms_norm`; returns how many.

    Only `forward` is replaced on the instance (module names, hooks and the weight parameter stay), and
    the weight is read at call time, so it is the tensor ZeRO-3 / FSDP2 gathered for that call.
    """
    norms = check_lean_norm(model)
    for norm in norms:
        norm.forward = lambda x, _m=norm: lean_rms_norm(x, _m.weight, _m.variance_epsilon)  # type: ignore[method-assign]
    return len(norms)
