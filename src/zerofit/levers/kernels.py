"""Fused kernels (`train.kernels`): Liger-Kernel's RMSNorm, SwiGLU and RoPE on the loaded model.

`liger` applies Liger-Kernel's Triton kernels to the model instance the way Hugging Face's Trainer does
(`transformers.integrations.liger.apply_liger_kernel`): `liger_kernel.transformers._apply_liger_kernel_to_instance`
on the transformers model underneath peft, with

- `rms_norm=True`: every decoder norm's `forward` becomes `LigerRMSNorm.forward` (Llama casting mode: the
  same formula as HF's, in one kernel that saves only the input and the fp32 rstd);
- `swiglu=True`: every MLP's `forward` becomes `LigerSwiGLUMLP.forward`, which calls the module's own
  `gate_proj`, `up_proj` and `down_proj` (so peft's LoRA-adapted linears stay and train) and fuses only
  `silu(gate) * up` (`LigerSiLUMulFunction`);
- `rope=True`: the model type's `apply_rotary_pos_emb` becomes `liger_rotary_pos_emb` (a module-level swap in
  `transformers.models.<type>.modeling_<type>`: every model of that type in this process gets it);
- `cross_entropy=False, fused_linear_cross_entropy=False`: zerofit computes the loss itself. Liger's fused
  linear cross-entropy is `train.cross_entropy=fused_linear` (`zerofit.token_loss.fused` runs
  `LigerFusedLinearCrossEntropyLoss` on CUDA where Liger is installed), which `resolve()` picks for a
  `train.kernels=liger` run that leaves `train.cross_entropy` unset.

The modules are kept (names, hooks, parameters), only their `forward` is rebound on the instance, so ZeRO-3
gathers, FSDP2 shards, activation checkpointing reruns them as before. The tiled MLP (`zerofit.levers.tiling`)
wraps whatever `mlp.forward` is when it is enabled, so the kernels are applied before it (`zerofit.models.build`):
each token shard then runs Liger's SwiGLU. Lean RMSNorm (`train.lean_norm`) replaces the same norm forward
and saves the same tensors as Liger's RMSNorm, so the two are not combined: `true` with `liger` is refused,
`auto` resolves to false.

Triton kernels run on CUDA only: a run on another device, or without the package installed, is refused
before the weights load with the fix. Equality (fp32, on CUDA): the token sums within 1e-5 relative and the
gradients within 1e-4 of their largest magnitude of the eager model's (tests/unit/levers/test_speed_levers.py, which
skips without CUDA and Liger).

`train.kernels` is the only switch: transformers 5 kernelizes a loaded model with the Hugging Face Hub's
`kernels` package whenever that package is importable (`use_kernels` defaults to true), and re-kernelizes on
every `train()` / `eval()`, which re-binds each norm's `forward` and silently drops zerofit's lean norms after
the first evaluation. `hub_kernels_off()` is passed to every model load (the run's model, a GRPO reward model,
export, generate, scoring and the built-in model's conversion), so what the run says it applied is what runs
and no kernel code is fetched from the Hub unasked.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from zerofit.core.errors import ConfigError

__all__ = [
    "KERNEL_MODEL_TYPES",
    "LIGER_INSTALL",
    "apply_kernels",
    "hub_kernels_off",
    "kernel_problems",
    "liger_kernels_available",
    "require_liger",
]

# Model types whose RMSNorm, SwiGLU MLP and rotary embedding are Llama's formulas, which Liger's kernels
# compute (and which `_apply_liger_kernel_to_instance` knows): zerofit's lean-norm set, the same classes.
KERNEL_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
LIGER_INSTALL = "pip install 'zerofit[liger]'"
_SWIGLU_ACTS = frozenset({"silu", "swish"})  # LigerSiLUMulFunction computes silu(gate) * up only


def hub_kernels_off() -> dict[str, bool]:
    """The `from_pretrained` keywords that keep transformers' hub kernelization off: `use_kernels=False` on
    transformers 5 (which pops it); nothing on 4.x, where it is off by default and an unknown keyword would
    reach the model's constructor. Read from the installed distribution, so transformers is not imported."""
    return {"use_kernels": False} if int(version("transformers").split(".")[0]) >= 5 else {}


def liger_kernels_available() -> bool:
    """True when Liger-Kernel's model kernels can be imported (they need Triton and a CUDA device to run)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_problems(kernels: str, model_type: str | None, hidden_act: str | None) -> list[str]:
    """Why `train.kernels` cannot run on this model (`model_type`, `hidden_act` from its config.json; None
    when unknown, e.g. custom code: then only the load can tell); [] when it can."""
    if kernels == "none":
        return []
    problems: list[str] = []
    if model_type is not None and model_type not in KERNEL_MODEL_TYPES:
        problems.append(
            f"train.kernels = {kernels!r} with a {model_type!r} model: Liger's RMSNorm, SwiGLU and RoPE compute "
            f"Llama's formulas, applied here to {sorted(KERNEL_MODEL_TYPES)} models only; use train.kernels=none"
        )
    if hidden_act is not None and hidden_act not in _SWIGLU_ACTS:
        problems.append(
            f"train.kernels = {kernels!r} with hidden_act = {hidden_act!r}: Liger's SwiGLU computes "
            "silu(gate) * up only; use train.kernels=none"
        )
    return problems


def require_liger(kernels: str) -> None:
    """Refuse `train.kernels` (other than none) where Liger-Kernel is not installed, with the fix."""
    if not liger_kernels_available():
        raise ConfigError(
            [f"train.kernels = {kernels!r} needs Liger-Kernel, which is not installed here; {LIGER_INSTALL}"]
        )


def apply_kernels(hf_model: Any, kernels: str) -> None:
    """Apply `train.kernels` to a transformers model (the one underneath peft); `none` leaves it as is."""
    if kernels == "none":
        return
    config = hf_model.config
    problems = kernel_problems(
        kernels, getattr(config, "model_type", None), getattr(config, "hidden_act", None)
    )
    if problems:
        raise ConfigError(problems)
    require_liger(kernels)
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=hf_model,
        rope=True,
        swiglu=True,
        rms_norm=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )
