"""A run on a vision-language model: its processor for the data, and the settings that cannot take images."""

from __future__ import annotations

from typing import Any

from zerofit.catalogue.vision_models import is_tiny_vlm
from zerofit.config.rules.engine import preset_zero_stage
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.models.build import resolve_model_path
from zerofit.models.vision import VisionProcessor, folder_config, is_vision_config, load_vision_processor
from zerofit.objectives.spec import ObjectiveSpec

# The image-token kinds (`VisionFamily.kind`) whose prompts the rollout samples (M-RoPE's grid: Qwen2-VL's).
GENERATING_KINDS = ("grid",)


def vision_processor_for(
    cfg: ZerofitConfig, tokenizer: Any, objective: ObjectiveSpec
) -> VisionProcessor | None:
    """The model's processor when `cfg` trains a vision-language model (None for a language model), after
    `refuse_vision_settings`."""
    path = resolve_model_path(cfg)
    if not is_vision_config(folder_config(path)):
        return None
    refuse_vision_settings(cfg, objective)
    processor = load_vision_processor(path, tokenizer, cfg.data.max_image_tokens, cfg.data.max_image_pixels)
    if objective.generates and processor.family.kind not in GENERATING_KINDS:
        raise ConfigError(
            [
                f"train.objective = {objective.name!r} samples its completions inside the run, and zerofit "
                f"samples image prompts on the Qwen2-VL family only so far (qwen2_vl, qwen2_5_vl: the built-in "
                f"tiny-qwen2-vl); model.name_or_path = {cfg.model.name_or_path!r} is {processor.family.model_type!r}; "
                "use a Qwen2-VL / Qwen2.5-VL model, or train.objective=sft"
            ]
        )
    return processor


def names_vision_model(cfg: ZerofitConfig) -> bool:
    """Whether `model.name_or_path` is known, without building or downloading anything, to be a
    vision-language model: a built-in one (`tiny-qwen2-vl`, ...) or a local folder whose config.json has a
    vision tower."""
    name = cfg.model.name_or_path
    return is_tiny_vlm(name) or is_vision_config(folder_config(name))


def refuse_vision_settings(cfg: ZerofitConfig, objective: ObjectiveSpec) -> None:
    """The settings a vision-language model cannot take, refused in one paragraph: a token budget (packing
    rows of several examples: it does not keep each image with its own tokens yet), an objective that takes
    no images (KTO, reward models),
    and ZeRO-3 (`_zero3_problem`). `recipe.run` calls it before the config is resolved, so local rank 0 says it
    once, before the planner's search and any model load."""
    name = cfg.model.name_or_path
    if cfg.batch.tokens_per_micro_batch is not None:
        raise ConfigError(
            [
                f"batch.tokens_per_micro_batch = {cfg.batch.tokens_per_micro_batch!r} with the vision-language "
                f"model {name!r}: zerofit does not pack image + text examples into shared rows (an image's "
                "tokens would need their own attention span and position grid); remove "
                "batch.tokens_per_micro_batch and use batch.micro_batch_size"
            ]
        )
    if not objective.vision:
        raise ConfigError(
            [
                f"train.objective = {objective.name!r} with the vision-language model {name!r}: zerofit "
                "trains vision-language models with train.objective sft, dpo, simpo, orpo, cpo and (on the Qwen2-VL "
                "family) grpo"
            ]
        )
    if preset_zero_stage(cfg) == 3:
        raise ConfigError([_zero3_problem(cfg, name)])


def _zero3_problem(cfg: ZerofitConfig, name: str) -> str:
    """Why a vision-language model does not train on ZeRO-3 yet: measured on 2 ranks (tiny-qwen2-vl, the demo
    data), the ranks' parameter gathers disagree once their micro-batches hold different images (gloo: a
    collective size mismatch, then an abort), where ZeRO-2 and FSDP2 give the one-process curve."""
    return (
        f"distributed.preset = {cfg.distributed.preset!r} is ZeRO-3 and {name!r} is a vision-language model: "
        "zerofit does not train vision-language models on ZeRO-3 yet (the ranks' parameter gathers disagree "
        "when their micro-batches hold different images); use distributed.preset=zero2, "
        "distributed.strategy=fsdp (which shards the parameters too), or single"
    )
