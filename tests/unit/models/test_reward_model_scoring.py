"""The `reward_model` reward (`zerofit.models.reward_model`): a sequence-classification folder (safetensors, no
code of its own, one label) scores prompt + completion through its chat template, in batches equal to one at a
time; folders that would run code or unpickle, or classify into several labels, are refused in one paragraph."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from zerofit.config.schema import RewardSpec
from zerofit.core.errors import ConfigError
from zerofit.models import reward_model as rm
from zerofit.models.tiny import TINY_CONFIGS, build_tokenizer
from zerofit.recipe.rewards import build_rewards


def _build(folder: Path, num_labels: int = 1) -> Path:
    """A seeded random LlamaForSequenceClassification of tiny-llama's shape, saved with its tokenizer."""
    import transformers

    tokenizer = build_tokenizer()
    data = {k: v for k, v in TINY_CONFIGS["tiny-llama"].items() if k != "architectures"}
    data.update(num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForSequenceClassification(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("rm") / "reward-model")


def test_batched_scores_equal_one_at_a_time_through_the_chat_template(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts = ["1+2=", "what is 7?", "x", "a longer prompt here"]
    completions = ["3", "seven, it is seven", "", "ok"]
    monkeypatch.setattr(rm, "BATCH_SIZE", 3)  # two batches, the first padded to its longest text
    fn = build_rewards([RewardSpec(function="reward_model", path=str(folder))], build_tokenizer())[0].fn
    scores = fn(prompts, completions, {"answer": [None] * 4})
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    for p, c, s in zip(prompts, completions, scores, strict=True):
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
        )
        assert p in text and text.startswith(tok.bos_token)  # the template's turns, not bare text
        with torch.no_grad():
            alone = model(torch.tensor([tok.encode(text, add_special_tokens=False)])).logits[0, 0].item()
        assert s == pytest.approx(alone, abs=1e-5)
    assert len(set(scores)) == 4 and all(isinstance(s, float) for s in scores)


def test_a_folder_with_code_is_refused_and_nothing_runs(folder: Path, tmp_path: Path) -> None:
    evil = Path(shutil.copytree(folder, tmp_path / "evil"))
    marker = tmp_path / "ran"
    (evil / "modeling_evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\n"
    )
    cfg = json.loads((evil / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForSequenceClassification": "modeling_evil.EvilForSequenceClassification"}
    (evil / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError, match=r"needs Python code of its own to load \(.*modeling_evil.py"
    ) as err:
        rm.reward_model(str(evil))
    assert "trust_remote_code stays off" in str(err.value) and not marker.exists()


def _refused(folder: Path) -> str:
    with pytest.raises(ConfigError) as err:
        rm.reward_model(str(folder))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_pickles_missing_weights_and_several_labels_are_refused(folder: Path, tmp_path: Path) -> None:
    pickled = Path(shutil.copytree(folder, tmp_path / "pickled"))
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert "holds only pickled weights (pytorch_model.bin)" in _refused(pickled)
    (pickled / "pytorch_model.bin").unlink()
    assert "no weights; zerofit loads a reward model from safetensors only" in _refused(pickled)
    assert "not a model folder (no config.json)" in _refused(tmp_path / "nowhere")
    assert "its classifier has 2 labels" in _refused(_build(tmp_path / "two", num_labels=2))


def test_the_score_falls_back_to_plain_text_without_a_template(folder: Path) -> None:
    model = rm.RewardModel(folder)
    model.tokenizer.chat_template = None
    assert model.render("1+2=", "3") == "1+2=3"
    scores: Any = model.score(["1+2="], ["3"])
    assert len(scores) == 1
