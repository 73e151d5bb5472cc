"""Render a resolved config into the typed spec of its engine, once (`render_spec`).

This is the one place where the batch plan meets an engine and where a preset or a user's DeepSpeed file
is read: the batch triple, precision, clipping, the optimizer hand-off, offload and the model-derived
bucket sizes are decided here, concretely, and every later reader (strategy, planner, printed plan, the
engine file in the run directory) takes them from the spec. No torch import: `zerofit plan` renders on
any machine.

DeepSpeed rules (from a preset, or a user's own file via `distributed.ds_config`, see `user_ds_config.py`):
  - batch triple from the plan; `gradient_clipping` = train.max_grad_norm (0.0 = off);
  - bf16 / fp16 blocks from train.precision (fp16 with dynamic loss scaling);
  - offload presets with optimizer.name=adamw get a DeepSpeed `optimizer` block (DeepSpeed's CPU Adam runs
    the step); otherwise the client passes its own torch/bitsandbytes optimizer, which ZeRO must be told
    to accept (`zero_allow_untested_optimizer`, and `zero_force_ds_cpu_optimizer: false` under offload);
  - bucket sizes from the model's hidden size where the preset or file does not fix them;
  - DeepSpeed's own monitors and step printing off: zerofit logs itself;
  - a user file's `scheduler` block is honoured: DeepSpeed builds that schedule (`engine_scheduler`), the
    strategy passes none of its own, and the plan says which schedule runs.
"""

from __future__ import annotations

import copy
import re
from typing import TYPE_CHECKING, Any

from zerofit.catalogue.layouts import layer_class_by_convention, model_layout
from zerofit.catalogue.models import model_config_dict
from zerofit.catalogue.presets import get_preset
from zerofit.core.derived_cache import cache_key, conforms, read_cache, write_cache
from zerofit.core.errors import ConfigError
from zerofit.core.precision import tensor_dtypes
from zerofit.engine_spec.deepspeed_keys import (
    bucket_keys,
    hidden_size_buckets,
    model_hidden_size,
    offloads,
    optimizer_block,
    precision_blocks,
)
from zerofit.engine_spec.spec import DeepSpeedSpec, EngineSpec, FSDPSpec, GradSync, LocalSpec
from zerofit.engine_spec.user_ds_config import filled_user_ds_config

if TYPE_CHECKING:
    from zerofit.resolution import ResolvedConfig

__all__ = ["decoder_layer_class", "render_spec"]

# Large enough that DeepSpeed never prints its own step lines; zerofit's console sink reports progress.
_STEPS_PER_PRINT = 10**9


def render_spec(resolved: ResolvedConfig, device_type: str = "cpu") -> EngineSpec:
    """The spec of the engine `resolved` names (DeepSpeed, FSDP2, or one process / DDP).

    `device_type` is the device the FSDP mesh is built on (`cpu` or `cuda`); other engines ignore it.
    Raises `ConfigError` for a user's DeepSpeed file that is unreadable or conflicts with the resolved
    config, and for a model whose shape zerofit cannot look up when the engine needs it.
    """
    strategy = resolved.config.distributed.strategy
    if strategy == "deepspeed":
        return _deepspeed(resolved)
    if strategy == "fsdp":
        return _fsdp(resolved, device_type)
    return _local(resolved)


def _common(resolved: ResolvedConfig) -> dict[str, Any]:
    """The fields every spec shares."""
    cfg = resolved.config
    return {
        "strategy": cfg.distributed.strategy,
        "preset": cfg.distributed.preset,
        "batch": resolved.batch,
        "dtypes": tensor_dtypes(cfg.train.precision, cfg.distributed.strategy, lora=cfg.lora.enabled),
        "max_grad_norm": cfg.train.max_grad_norm,
        "timeout_minutes": cfg.distributed.timeout_minutes,
        "sequence_parallel": cfg.distributed.sequence_parallel,
    }


# --------------------------------------------------------------------------------------------- DeepSpeed


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


def _optimizer_keys(resolved: ResolvedConfig, offload_optimizer: bool) -> dict[str, Any]:
    """The optimizer keys zerofit adds when the DeepSpeed config names no optimizer: DeepSpeed's CPU Adam
    for AdamW with the optimizer offloaded, else permission for the client's own optimizer."""
    if offload_optimizer and resolved.config.optimizer.name == "adamw":
        # DeepSpeed's CPU Adam runs the step on the host; a torch AdamW there would be far slower.
        return {"optimizer": optimizer_block(resolved)}
    # The client passes its own torch / bitsandbytes optimizer to deepspeed.initialize.
    keys: dict[str, Any] = {"zero_allow_untested_optimizer": True}
    if offload_optimizer:
        keys["zero_force_ds_cpu_optimizer"] = False
    return keys


def _monitors_off() -> dict[str, Any]:
    """DeepSpeed's own logging, off: zerofit writes metrics.jsonl / W&B itself, and DeepSpeed's monitors
    would log a second, differently stepped copy (DeepSpeed counts micro-steps in some places)."""
    return {
        "steps_per_print": _STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "tensorboard": {"enabled": False},
        "wandb": {"enabled": False},
        "csv_monitor": {"enabled": False},
    }


def _deepspeed(resolved: ResolvedConfig) -> DeepSpeedSpec:
    cfg, plan = resolved.config, resolved.batch
    user_file = cfg.distributed.ds_config
    if user_file is not None:
        # Every `auto` filled, every hard-coded value checked against the plan (raises on conflicts).
        body = filled_user_ds_config(resolved)
    else:
        body = copy.deepcopy(get_preset(str(cfg.distributed.preset)).body)

    ours: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        **precision_blocks(cfg.train.precision),
        "gradient_clipping": float(cfg.train.max_grad_norm or 0.0),
    }

    zero = body.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    offload_optimizer = offloads(zero, "offload_optimizer")
    if "optimizer" not in body:
        ours.update(_optimizer_keys(resolved, offload_optimizer))

    stage = int(zero.get("stage", 0))
    if "zero_optimization" in body:
        missing = [k for k in bucket_keys(stage) if k not in zero]
        if missing:
            buckets = hidden_size_buckets(model_hidden_size(cfg.model.name_or_path), stage)
            ours["zero_optimization"] = {k: buckets[k] for k in missing}

    ours.update(_monitors_off())
    config = _merge_missing(ours, body)
    block = config.get("optimizer")
    return DeepSpeedSpec(
        **_common(resolved),
        sync=GradSync(
            "every_micro_step" if stage >= 2 else "boundary_only",
            "ZeRO-2/3 reduce-scatter every micro-step into their gradient partitions (by design)"
            if stage >= 2
            else "ZeRO-0/1 reduce gradients once per window, at the accumulation boundary",
        ),
        grad_divide_factor=_deepspeed_divide_factor(
            plan.dp_size, cfg.distributed.sequence_parallel, stage, zero
        ),
        config=config,
        zero_stage=stage,
        offload_optimizer=offload_optimizer,
        offload_params=offloads(zero, "offload_param"),
        engine_optimizer=str(block.get("type", "optimizer")) if isinstance(block, dict) else None,
        user_file=user_file,
        engine_scheduler=_scheduler_type(config),
    )


def _deepspeed_divide_factor(dp: int, sp: int, stage: int, zero: dict[str, Any]) -> float:
    """What DeepSpeed divides the sum of every rank's gradient by (the loop multiplies its loss by it).

    DeepSpeed averages over the dp ranks: it sums over every rank and divides by world / sequence_parallel
    = dp (the engine's `_reduce_non_expert_gradients`, ZeRO-1/2's `div_(world / sp)`); under Ulysses a
    parameter's full gradient is the sum over its group's shards, so dp is exact. ZeRO-3's reduce-scatter
    (`reduce_scatter_coalesced`, DeepSpeed 0.19.8) divides by the whole partition group, world = dp x N,
    without the sequence-parallel correction (measured: half the gradient at N = 2); its other path, the
    contiguous all-reduce, divides by dp but is taken only for buckets under `reduce_bucket_size`, so
    ZeRO-3 with N > 1 keeps `reduce_scatter` on (DeepSpeed's default) and counts world.
    """
    if sp == 1 or stage < 3:
        return float(dp)
    if zero.get("reduce_scatter", True) is False:
        raise ConfigError(
            [
                f"distributed.sequence_parallel = {sp} with ZeRO-3 needs zero_optimization.reduce_scatter = "
                "true (DeepSpeed's default): with it off, DeepSpeed divides some gradient buckets by the data-"
                "parallel size and others by the world size, and the gradient would not be exact; drop "
                "reduce_scatter from the DeepSpeed file, or set distributed.sequence_parallel=1"
            ]
        )
    return float(dp * sp)


def _scheduler_type(config: dict[str, Any]) -> str | None:
    """The `scheduler.type` DeepSpeed will build (the user file's block; checked by `user_ds_config`)."""
    block = config.get("scheduler")
    return str(block["type"]) if isinstance(block, dict) and "type" in block else None


# --------------------------------------------------------------------------------------------- FSDP2


def decoder_layer_class(model_cfg: dict[str, Any]) -> str:
    """The transformer-block class FSDP shards one by one, from an HF config dict: what the model class
    itself says stays whole (`_no_split_modules` of `architectures`' transformers class, no weights), else
    transformers' naming convention (`<Arch>ForCausalLM` -> `<Arch>DecoderLayer`, for custom code; the
    strategy checks the loaded model has that class and refuses naming it when not)."""
    if (
        "vision_config" in model_cfg
    ):  # a vision-language model: its vision blocks and decoder layers, comma-joined
        declared = [n for a in model_cfg.get("architectures") or [] for n in _no_split_modules(str(a))]
        declared += _sub_model_blocks(model_cfg)
        if declared:
            return ",".join(dict.fromkeys(declared))
    archs = [
        a for a in model_cfg.get("architectures") or [] if isinstance(a, str) and a.endswith("ForCausalLM")
    ]
    for arch in [*archs, *_causal_lm_class(model_cfg.get("model_type"))]:
        declared = _no_split_modules(arch)
        if declared:
            return next((name for name in declared if name.endswith("DecoderLayer")), declared[0])
    for arch in archs:
        return layer_class_by_convention(arch)
    raise ConfigError(
        [
            f"distributed.strategy = 'fsdp': cannot tell which module class is the decoder layer of model_type "
            f"{model_cfg.get('model_type')!r} (architectures {model_cfg.get('architectures')!r}: no "
            "transformers causal-LM class declaring _no_split_modules, no <Arch>ForCausalLM name) to shard per layer. Fix: "
            "distributed.strategy=deepspeed, or a model whose config.json names its transformers class"
        ]
    )


_LAYER_CLASS = re.compile(r"[A-Za-z_]\w*(,[A-Za-z_]\w*)*")  # class names, comma-joined


def cached_layer_class(model_cfg: dict[str, Any]) -> str:
    """`decoder_layer_class`, kept in `zerofit.core.derived_cache`: it reads transformers' model class, whose
    import costs seconds (its modeling stack), for a fact of the config and the library versions, and every
    `zerofit plan` of an FSDP run renders it. A cached answer is checked before use (class names only). A
    family whose layout `zerofit.catalogue.layouts` reads from the config names its block class(es) there
    (held equal to the class's declaration by tests/unit/planner/test_config_layout.py)."""
    layout = model_layout(model_cfg)
    if layout is not None:  # a family zerofit reads from its config: its declared block class(es)
        return layout.block_class
    key = cache_key("fsdp_layer_class", 1, {"config": model_cfg})
    entry = read_cache(key) or {}
    cached = (
        entry.get("layer_class")
        if conforms(entry, dict[str, str]) and set(entry) == {"layer_class"}
        else None
    )
    if cached is not None and _LAYER_CLASS.fullmatch(cached):
        return cached
    layer_class = decoder_layer_class(model_cfg)
    write_cache(key, {"layer_class": layer_class})
    return layer_class


def _sub_model_blocks(model_cfg: dict[str, Any]) -> list[str]:
    """`_no_split_modules` of a vision-language model's vision tower and language model classes (its
    `vision_config` / `text_config` model types' transformers classes): some families' own class names only
    part of them (Gemma 3: its decoder layer, not SigLIP's; LLaVA: none)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names: list[str] = []
    for key in ("vision_config", "text_config"):
        sub = model_cfg.get(key)
        cls = MODEL_MAPPING_NAMES.get(sub.get("model_type")) if isinstance(sub, dict) else None
        names += _no_split_modules(cls) if isinstance(cls, str) else []
    return names


def _causal_lm_class(model_type: Any) -> list[str]:
    """The causal-LM class transformers' Auto classes build for `model_type` (a config without
    `architectures`), as a list of none or one name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    return [name] if isinstance(name, str) else []


def _no_split_modules(arch: str) -> list[str]:
    """`_no_split_modules` of transformers class `arch` (the class only: no model is built), [] if unknown."""
    import transformers

    try:
        cls = getattr(transformers, arch)
    except (AttributeError, ImportError, RuntimeError):
        return []
    return list(getattr(cls, "_no_split_modules", None) or [])


_FSDP_SYNC_EVERY = (
    "Gradients are reduce-scattered and moved to the CPU after every micro-step: skipping the sync "
    "would keep a full unsharded gradient on the accelerator across the window, which is exactly "
    "the memory CPU offload exists to save; the price is one reduce-scatter per micro-step."
)
_FSDP_SYNC_BOUNDARY = (
    "Gradient reduce-scatter is skipped on non-boundary micro-steps (set_requires_gradient_sync"
    "(False)), saving communication at the cost of holding an unsharded gradient copy per rank "
    "(about one full gradient of the trainable parameters) until the last micro-step."
)
_FSDP_NOTES = (
    "gradient_divide_factor 1.0 makes FSDP sum gradients over ranks instead of averaging them. "
    "The loop divides every micro-batch's summed token loss by the valid-token count of the whole "
    "global batch (all-reduced over dp before the first backward), so the sum over ranks is already "
    "the global token mean: nothing else may rescale it (no division by dp or grad_accum_steps). "
    "A loop that keeps FSDP's default averaging must instead multiply its loss by dp."
)


def _fsdp(resolved: ResolvedConfig, device_type: str) -> FSDPSpec:
    cfg = resolved.config
    preset = get_preset(str(cfg.distributed.preset))
    cpu_offload = bool(preset.body.get("cpu_offload", False))
    return FSDPSpec(
        **_common(resolved),
        sync=GradSync("every_micro_step", _FSDP_SYNC_EVERY)
        if cpu_offload
        else GradSync("boundary_only", _FSDP_SYNC_BOUNDARY),
        grad_divide_factor=1.0,  # FSDP sums; the loop's normalizer is already the global token count
        mesh_device_type=device_type,
        reshard_after_forward=bool(preset.body.get("reshard_after_forward", True)),
        cpu_offload=cpu_offload,
        # Pinned host memory needs an accelerator; on a CPU-only machine pinning raises.
        pin_memory=cpu_offload and device_type != "cpu",
        layer_class=cached_layer_class(model_config_dict(cfg.model.name_or_path)),
        notes=_FSDP_NOTES,
    )


# --------------------------------------------------------------------------------------------- DDP / single


def _local(resolved: ResolvedConfig) -> LocalSpec:
    if resolved.config.distributed.strategy == "ddp":
        sync = GradSync(
            "boundary_only",
            "Gradient all-reduce runs only on the last micro-step of a window (DDP no_sync() on the "
            "others): the local gradients accumulate in place, so skipping the sync costs no memory.",
        )
        notes = (
            "DDP averages gradients over ranks; the loop divides each micro-batch's summed token loss by the "
            "global valid-token count and multiplies by dp to undo that average."
        )
        divide = float(resolved.batch.dp_size)
    else:
        sync = GradSync("none", "One process: there is no gradient communication to skip.")
        notes = (
            "One process; the loop divides each micro-batch's summed token loss by the window's token count."
        )
        divide = 1.0
    return LocalSpec(**_common(resolved), sync=sync, grad_divide_factor=divide, notes=notes)
