"""A run on a vision-language model: its processor for the data, and the settings that cannot take images."""

from __future__ import annotations

from typing import Any

from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.models.build import resolve_model_path
from zerofit.models.vision import VisionProcessor, folder_config, is_vision_config, load_vision_processor


def vision_processor_for(cfg: ZerofitConfig, tokenizer: Any) -> VisionProcessor | None:
    """The model's processor when `cfg` trains a vision-language model (None for a language model); a
    token budget (packing rows of several examples) or a preference objective is refused, one paragraph:
    neither keeps each image with its own tokens yet."""
    path = resolve_model_path(cfg)
    if not is_vision_config(folder_config(path)):
        return None
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
    if cfg.train.objective != "sft":
        raise ConfigError(
            [
                f"train.objective = {cfg.train.objective!r} with the vision-language model {name!r}: zerofit "
                "trains vision-language models with train.objective=sft only"
            ]
        )
    return load_vision_processor(path, tokenizer, cfg.data.max_image_tokens)
