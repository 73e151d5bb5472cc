"""Render a resolved config into the exact dict an engine receives (DeepSpeed config, FSDP2 plan, DDP plan).

This is the one place where the batch plan meets an engine: the batch triple, precision, clipping, the
optimizer hand-off and the model-derived bucket sizes are written here, concretely, so the file in the run
directory is what the engine actually ran with. No torch import: `zerofit plan` renders on any machine.

DeepSpeed rules (from a preset, or a user's own file via `distributed.ds_config`, see `foreign_ds.py`):
  - batch triple from the plan; `gradient_clipping` = train.max_grad_norm (0.0 = off);
  - bf16 / fp16 blocks from train.precision (fp16 with dynamic loss scaling);
  - offload presets with optimizer.name=adamw get a DeepSpeed `optimizer` block (DeepSpeed's CPU Adam runs
    the step); otherwise the client passes its own torch/bitsandbytes optimizer, which ZeRO must be told
    to accept (`zero_allow_untested_optimizer`, and `zero_force_ds_cpu_optimizer: false` under offload);
  - bucket sizes from the model's hidden size where the preset or file does not fix them;
  - DeepSpeed's own monitors and step printing off: zerofit logs itself.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from zerofit.errors import ConfigError
from zerofit.planner.catalogue import model_config_dict
from zerofit.presets import get_preset

if TYPE_CHECKING:
    from zerofit.config.resolve import ResolvedConfig

__all__ = [
    "FP16_DYNAMIC_LOSS_SCALING",
    "decoder_layer_class",
    "deepspeed_builds_optimizer",
    "deepspeed_precision_blocks",
    "engine_config_filename",
    "render_engine_config",
]

# DeepSpeed's dynamic loss scaling: start at 2**16, halve on overflow (after `hysteresis` overflows),
# double after `loss_scale_window` clean steps, never below 1. `loss_scale: 0` selects dynamic scaling.
FP16_DYNAMIC_LOSS_SCALING: dict[str, Any] = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}

# Large enough that DeepSpeed never prints its own step lines; zerofit's console sink reports progress.
_STEPS_PER_PRINT = 10**9

# torch dtype names by train.precision (FSDP mixed precision, autocast).
_DTYPE_NAME = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Decoder-layer class by HF `model_type`, for the FSDP wrap policy; other models fall back to
# `<Arch>ForCausalLM` -> `<Arch>DecoderLayer`, the transformers naming convention.
_DECODER_LAYER_BY_MODEL_TYPE = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
}

_FILENAMES = {
    "deepspeed": "ds_config.json",
    "fsdp": "fsdp.json",
    "single": "engine.json",
    "ddp": "engine.json",
}


def engine_config_filename(strategy: str) -> str:
    """File name of the rendered engine config inside the run directory (DESIGN contract 3)."""
    try:
        return _FILENAMES[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(_FILENAMES)}") from None


def render_engine_config(resolved: ResolvedConfig, device_type: str = "cpu") -> dict[str, Any]:
    """The exact dict the engine receives for `resolved` (DeepSpeed config, FSDP plan or DDP/single plan).

    `device_type` is the device the FSDP mesh is built on (`cpu` or `cuda`); DeepSpeed ignores it.
    Raises `ConfigError` for a user's DeepSpeed file that conflicts with the resolved config, and for a
    model whose shape zerofit cannot look up when the engine needs it.
    """
    strategy = resolved.config.distributed.strategy
    if strategy == "deepspeed":
        return _render_deepspeed(resolved)
    if strategy == "fsdp":
        return _render_fsdp(resolved, device_type)
    return _render_local(resolved)


# --------------------------------------------------------------------------------------------- DeepSpeed


def deepspeed_precision_blocks(precision: str) -> dict[str, dict[str, Any]]:
    """The `bf16` and `fp16` blocks for `train.precision`; both are written so neither default applies."""
    fp16: dict[str, Any] = {"enabled": precision == "fp16"}
    if precision == "fp16":
        fp16.update(FP16_DYNAMIC_LOSS_SCALING)
    return {"bf16": {"enabled": precision == "bf16"}, "fp16": fp16}


def deepspeed_builds_optimizer(engine_config: dict[str, Any]) -> bool:
    """True when DeepSpeed creates the optimizer from the config's `optimizer` block (no client optimizer)."""
    return "optimizer" in engine_config


def deepspeed_optimizer_block(resolved: ResolvedConfig) -> dict[str, Any]:
    """DeepSpeed's AdamW with zerofit's hyper-parameters (used where DeepSpeed must own the optimizer)."""
    opt = resolved.config.optimizer
    return {
        "type": "AdamW",
        "params": {
            "lr": resolved.effective_lr,
            "betas": list(opt.betas),
            "eps": opt.eps,
            "weight_decay": opt.weight_decay,
        },
    }


def bucket_keys(stage: int) -> tuple[str, ...]:
    """The `zero_optimization` keys zerofit sizes from the model width at this ZeRO stage."""
    if stage == 3:
        return ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    return ("reduce_bucket_size",)


def hidden_size_buckets(hidden_size: int, stage: int) -> dict[str, int]:
    """Communication bucket sizes from the model width (the HF Trainer's `auto` rules)."""
    h = hidden_size
    buckets = {"reduce_bucket_size": h * h}
    if stage == 3:
        buckets["stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        buckets["stage3_param_persistence_threshold"] = 10 * h
    return buckets


def model_hidden_size(name_or_path: str) -> int:
    """The model's `hidden_size`, from the built-in catalogue or a local config.json (no weights read)."""
    model_cfg = model_config_dict(name_or_path)
    hidden = model_cfg.get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        raise ConfigError(
            [
                f"model.name_or_path = {name_or_path!r}: its config has no positive integer hidden_size "
                f"(got {hidden!r}), so zerofit cannot size DeepSpeed's communication buckets; set "
                "zero_optimization.reduce_bucket_size (and the stage3_* sizes) in your own file via "
                "distributed.ds_config"
            ]
        )
    return hidden


def _offloads_optimizer(zero: dict[str, Any]) -> bool:
    offload = zero.get("offload_optimizer") or {}
    return isinstance(offload, dict) and offload.get("device", "none") not in ("none", None)


def _merge_missing(ours: dict[str, Any], theirs: dict[str, Any], ours_first: bool = True) -> dict[str, Any]:
    """`theirs` merged over `ours` (theirs wins on every leaf).

    Key order only serves the reader of ds_config.json: at the top level zerofit's keys (the batch triple)
    come first; inside a block (zero_optimization) the preset's or user's keys come first.
    """
    first, second = (ours, theirs) if ours_first else (theirs, ours)
    out: dict[str, Any] = {}
    for key in [*first, *(k for k in second if k not in first)]:
        mine, other = ours.get(key), theirs.get(key)
        if isinstance(mine, dict) and isinstance(other, dict):
            out[key] = _merge_missing(mine, other, ours_first=False)
        else:
            out[key] = copy.deepcopy(other if key in theirs else mine)
    return out


def _render_deepspeed(resolved: ResolvedConfig) -> dict[str, Any]:
    # Imported here: foreign_ds uses helpers of this module.
    from zerofit.foreign_ds import filled_foreign_ds_config

    cfg = resolved.config
    plan = resolved.plan
    if cfg.distributed.ds_config is not None:
        # Every `auto` filled, every hard-coded value checked against the plan (raises on conflicts).
        body = filled_foreign_ds_config(resolved)
    else:
        body = copy.deepcopy(get_preset(str(cfg.distributed.preset)).body)

    ours: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        **deepspeed_precision_blocks(cfg.train.precision),
        "gradient_clipping": float(cfg.train.max_grad_norm or 0.0),
    }

    zero = body.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    if "optimizer" not in body:
        if _offloads_optimizer(zero) and cfg.optimizer.name == "adamw":
            # DeepSpeed's CPU Adam runs the step on the host; a torch AdamW there would be far slower.
            ours["optimizer"] = deepspeed_optimizer_block(resolved)
        else:
            # The client passes its own torch / bitsandbytes optimizer to deepspeed.initialize.
            ours["zero_allow_untested_optimizer"] = True
            if _offloads_optimizer(zero):
                ours["zero_force_ds_cpu_optimizer"] = False

    if "zero_optimization" in body:
        stage = int(zero.get("stage", 0))
        missing = [k for k in bucket_keys(stage) if k not in zero]
        if missing:
            buckets = hidden_size_buckets(model_hidden_size(cfg.model.name_or_path), stage)
            ours["zero_optimization"] = {k: buckets[k] for k in missing}

    # zerofit writes metrics.jsonl / W&B itself; DeepSpeed's monitors would log a second, differently
    # stepped copy (DeepSpeed counts micro-steps in some places).
    ours.update(
        {
            "steps_per_print": _STEPS_PER_PRINT,
            "wall_clock_breakdown": False,
            "tensorboard": {"enabled": False},
            "wandb": {"enabled": False},
            "csv_monitor": {"enabled": False},
        }
    )
    return _merge_missing(ours, body)


# --------------------------------------------------------------------------------------------- FSDP2


def decoder_layer_class(model_cfg: dict[str, Any]) -> str:
    """The transformer-block class FSDP shards one by one, from an HF config dict."""
    model_type = model_cfg.get("model_type")
    if model_type in _DECODER_LAYER_BY_MODEL_TYPE:
        return _DECODER_LAYER_BY_MODEL_TYPE[model_type]
    for arch in model_cfg.get("architectures") or []:
        if isinstance(arch, str) and arch.endswith("ForCausalLM"):
            return arch.removesuffix("ForCausalLM") + "DecoderLayer"
    raise ConfigError(
        [
            f"cannot tell which module class is the decoder layer of model_type {model_type!r} "
            f"(architectures {model_cfg.get('architectures')!r}) for FSDP wrapping; use "
            "distributed.strategy=deepspeed or a llama / mistral / qwen2 model"
        ]
    )


def _train_batch(resolved: ResolvedConfig) -> dict[str, int]:
    p = resolved.plan
    return {
        "global_batch_size": p.global_batch_size,
        "micro_batch_size": p.micro_batch_size,
        "grad_accum_steps": p.grad_accum_steps,
        "dp_size": p.dp_size,
    }


def _render_fsdp(resolved: ResolvedConfig, device_type: str) -> dict[str, Any]:
    cfg = resolved.config
    preset = get_preset(str(cfg.distributed.preset))
    reshard = bool(preset.body.get("reshard_after_forward", True))
    cpu_offload = bool(preset.body.get("cpu_offload", False))
    dtype = _DTYPE_NAME[cfg.train.precision]
    n = resolved.plan.grad_accum_steps
    if cpu_offload:
        sync = "every_micro_step"
        reason = (
            "Gradients are reduce-scattered and moved to the CPU after every micro-step: skipping the sync "
            "would keep a full unsharded gradient on the accelerator across the window, which is exactly "
            "the memory CPU offload exists to save; the price is one reduce-scatter per micro-step."
        )
    else:
        sync = "boundary_only"
        reason = (
            "Gradient reduce-scatter is skipped on non-boundary micro-steps (set_requires_gradient_sync"
            "(False)), saving communication at the cost of holding an unsharded gradient copy per rank "
            "(about one full gradient of the trainable parameters) until the last micro-step."
        )
    return {
        "strategy": "fsdp",
        "preset": preset.name,
        "mesh": {"device_type": device_type, "shape": [resolved.plan.dp_size], "dim_names": ["dp"]},
        "reshard_after_forward": reshard,
        "cpu_offload": cpu_offload,
        # Pinned host memory needs an accelerator; on a CPU-only machine pinning raises.
        "cpu_offload_pin_memory": cpu_offload and device_type != "cpu",
        "mixed_precision": {"param_dtype": dtype, "reduce_dtype": "float32", "output_dtype": dtype},
        "grad_scaler": cfg.train.precision == "fp16",
        "wrap": {"layer_class": decoder_layer_class(model_config_dict(cfg.model.name_or_path)), "root": True},
        "gradient_accumulation": {"grad_accum_steps": n, "sync": sync, "reason": reason},
        "gradient_divide_factor": 1.0,
        "notes": (
            "gradient_divide_factor 1.0 makes FSDP sum gradients over ranks instead of averaging them. "
            "The loop divides every micro-batch's summed token loss by the valid-token count of the whole "
            "global batch (all-reduced over dp before the first backward), so the sum over ranks is already "
            "the global token mean: nothing else may rescale it (no division by dp or grad_accum_steps). "
            "A loop that keeps FSDP's default averaging must instead multiply its loss by dp."
        ),
        "train_batch": _train_batch(resolved),
        "max_grad_norm": cfg.train.max_grad_norm,
    }


# --------------------------------------------------------------------------------------------- DDP / single


def _render_local(resolved: ResolvedConfig) -> dict[str, Any]:
    cfg = resolved.config
    strategy = cfg.distributed.strategy
    n = resolved.plan.grad_accum_steps
    if strategy == "ddp":
        accumulation = {
            "grad_accum_steps": n,
            "sync": "boundary_only",
            "reason": (
                "Gradient all-reduce runs only on the last micro-step of a window (DDP no_sync() on the "
                "others): the local gradients accumulate in place, so skipping the sync costs no memory."
            ),
        }
        notes = (
            "DDP averages gradients over ranks; the loop divides each micro-batch's summed token loss by the "
            "global valid-token count and multiplies by dp to undo that average."
        )
    else:
        accumulation = {
            "grad_accum_steps": n,
            "sync": "none",
            "reason": "One process: there is no gradient communication to skip.",
        }
        notes = (
            "One process; the loop divides each micro-batch's summed token loss by the window's token count."
        )
    return {
        "strategy": strategy,
        "precision": cfg.train.precision,
        "autocast_dtype": None if cfg.train.precision == "fp32" else _DTYPE_NAME[cfg.train.precision],
        "grad_scaler": cfg.train.precision == "fp16",
        "train_batch": _train_batch(resolved),
        "gradient_accumulation": accumulation,
        "notes": notes,
        "max_grad_norm": cfg.train.max_grad_norm,
    }
