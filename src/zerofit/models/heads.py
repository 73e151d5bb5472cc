"""Which transformers head a run trains: the causal LM, or (`train.objective: reward`) a reward model.

A reward model is the family's own `...ForSequenceClassification` with one output (`num_labels=1`): the
decoder of the causal LM plus a linear `score` head that reads the hidden state of each row's last non-pad
token (transformers finds it from `config.pad_token_id`, which `set_pad_token` sets to the tokenizer's, so a
right-padded row is scored at its last real token). Loaded from a causal-LM checkpoint, the score head is
new: it is initialized from the run's seed, so every rank and every split starts from the same head.
Under LoRA the head trains in full (peft's `SEQ_CLS` task puts it in `modules_to_save`); under QLoRA it stays
out of 4-bit (`quantization_skip`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.models.vision import folder_model_class
from zerofit.objectives.registry import objective_of
from zerofit.objectives.reward_model.head import SCORE_HEAD

__all__ = [
    "SCORE_HEAD",
    "auto_model_class",
    "head_kwargs",
    "is_reward_model",
    "meta_head_model",
    "refuse_reward_model",
    "seeded_head",
    "set_pad_token",
]


def is_reward_model(cfg: ZerofitConfig) -> bool:
    """Whether the run trains a reward model (a one-output score head) rather than the causal LM."""
    return objective_of(cfg).score_head


def auto_model_class(cfg: ZerofitConfig, path: str | Path | None = None) -> Any:
    """transformers' auto class of the model the run trains (and `zerofit export` rebuilds): a reward model's
    sequence classifier; else the class that loads the folder at `path` whole (image-text-to-text for a
    vision-language model, `zerofit.models.vision`); else the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if is_reward_model(cfg):
        return AutoModelForSequenceClassification
    return AutoModelForCausalLM if path is None else folder_model_class(path)


def head_kwargs(cfg: ZerofitConfig) -> dict[str, Any]:
    """`from_pretrained`'s extra arguments for the head: one output for a reward model (TRL's num_labels=1)."""
    return {"num_labels": 1} if is_reward_model(cfg) else {}


@contextmanager
def seeded_head(cfg: ZerofitConfig) -> Iterator[None]:
    """A reward model's new score head initialized from the run's seed (the caller's RNG untouched): the same
    head on every rank and every split. Nothing for a causal LM."""
    if not is_reward_model(cfg):
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        yield


def set_pad_token(cfg: ZerofitConfig, model: torch.nn.Module, tokenizer: Any) -> None:
    """A reward model's pad id, which transformers' sequence classifier pools by (the last token that is not
    it): the tokenizer's, which pads the batches. A causal LM's config is left as loaded. `model` may be peft's
    wrapper (its base model's config is set)."""
    get_base = getattr(model, "get_base_model", None)
    config = getattr(get_base() if callable(get_base) else model, "config", None)
    if config is None or not is_reward_model(cfg) or tokenizer.pad_token_id is None:
        return
    config.pad_token_id = tokenizer.pad_token_id
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.pad_token_id = tokenizer.pad_token_id


def refuse_reward_model(cfg: ZerofitConfig, where: object, what: str) -> None:
    """Refuse `what` (a GGUF export, generation) for a reward model's run `where`: it scores, it does not write."""
    if is_reward_model(cfg):
        raise ConfigError(
            [
                f"{where} is a reward model (train.objective: reward): a sequence classifier whose score head gives "
                f"one number per text, with no language-model head for {what}. Score with it instead: zerofit "
                f'score {where} --prompt "..." --response "...", or export it as a Hugging Face folder '
                "(zerofit export RUN --merge --out DIR)"
            ]
        )


def meta_head_model(cfg: ZerofitConfig, path: str) -> Any:
    """The model the run trains, on the meta device (shapes and names, no memory): the causal LM, or a
    reward model's one-output sequence classifier (whose checkpoints hold the score head's tensors)."""
    from zerofit.models.meta import build_meta_model, hf_config

    if not is_reward_model(cfg):
        return build_meta_model(path)
    config = hf_config(path)
    config.num_labels = 1
    with torch.device("meta"):
        return auto_model_class(cfg).from_config(config, dtype=torch.float32)
