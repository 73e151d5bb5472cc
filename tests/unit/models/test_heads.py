"""A reward model's build (`zerofit.models.heads`): the family's one-output sequence classifier with a seeded
score head, pooled by the tokenizer's pad id; under LoRA the head trains in full, under QLoRA it stays out of
4-bit, full fine-tuning trains everything; `train.cross_entropy` other than chunked is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from config_helpers import config
from zerofit.config import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.data import Example
from zerofit.data.pairs import PreferencePair, collate_pairs
from zerofit.models.build import build_model
from zerofit.objectives.reward_model.loss import RewardObjective
from zerofit.resolution import resolve

PAIR = PreferencePair(
    Example([1, 40, 41, 42, 43, 2], [-100, -100, 41, 42, 43, 2]), Example([1, 40, 50, 2], [-100, -100, 50, 2])
)


def _cfg(**sections: dict[str, Any]) -> ZerofitConfig:
    train = {"objective": "reward", "precision": "fp32", **sections.pop("train", {})}
    return config({"seed": 0, "lora": {"dropout": 0.0}}, train=train, **sections)


def _backward(model: torch.nn.Module, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """One reward-loss backward on a pair (padded with `pad_id`); the gradients of the trainable parameters."""
    batch = collate_pairs([PAIR], pad_id=pad_id)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    (loss,), _ = RewardObjective(0.01).terms(model, inputs, batch, "chunked")
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_lora_reward_model_trains_adapters_and_the_whole_score_head() -> None:
    built = build_model(_cfg())
    model = built.model
    hf = model.get_base_model()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    assert hf.config.pad_token_id == built.tokenizer.pad_token_id
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    score = {n for n in trainable if ".score." in n}
    assert score and all("modules_to_save" in n for n in score)  # peft's trained copy of the head
    assert all("lora_" in n for n in trainable - score)
    grads = _backward(model)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if ".score." in n)
    # The new head comes from the run's seed: the same on every rank and every build.
    again = build_model(_cfg()).model.get_base_model()
    torch.testing.assert_close(hf.score.original_module.weight, again.score.original_module.weight)


def test_full_fine_tuning_trains_every_weight() -> None:
    model = build_model(_cfg(lora={"enabled": False})).model
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert all(p.requires_grad for p in model.parameters())
    assert set(_backward(model)) == {n for n, _ in model.named_parameters()}


def test_qlora_keeps_the_score_head_out_of_4bit() -> None:
    model = build_model(_cfg(train={"precision": "bf16"}, quantization={"load_in": "4bit"})).model
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear4bit" in kinds
    head = model.get_base_model().score.modules_to_save["default"]
    assert type(head) is torch.nn.Linear and head.weight.requires_grad
    assert any(g.abs().sum() > 0 for n, g in _backward(model).items() if ".score." in n)


def test_a_vocabulary_loss_is_refused_for_a_reward_model() -> None:
    batch = {"global_batch_size": 4, "micro_batch_size": 2}
    with pytest.raises(
        ConfigError, match=r"train\.cross_entropy = 'fused_linear' with train\.objective = 'reward'"
    ):
        resolve(_cfg(train={"cross_entropy": "fused_linear"}, batch=batch), world_size=1)
    assert resolve(_cfg(batch=batch), world_size=1).config.train.cross_entropy == "chunked"


@pytest.mark.slow  # eleven builds
def test_every_built_in_family_builds_a_reward_model() -> None:
    """Each built-in tiny family as its own sequence classifier, LoRA, the score head getting a gradient."""
    from zerofit.catalogue.models import TINY_CONFIGS

    for name in sorted(TINY_CONFIGS):
        built = build_model(_cfg(model={"name_or_path": name}))
        hf = built.model.get_base_model()
        assert type(hf).__name__.endswith("ForSequenceClassification"), name
        assert hf.config.pad_token_id == built.tokenizer.pad_token_id, name
        grads = _backward(built.model, built.tokenizer.pad_token_id)
        assert any(g.abs().sum() > 0 for n, g in grads.items() if ".score." in n), name
