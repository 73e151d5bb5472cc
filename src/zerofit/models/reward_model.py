"""The `reward_model` reward (`rl.rewards: [{function: reward_model, path: FOLDER}]`): a sequence-classification
model scores each prompt + completion, one scalar per completion.

FOLDER is a standard Hugging Face `AutoModelForSequenceClassification` folder with its tokenizer (what
`zerofit export` of a reward-model run writes, and TRL's RewardTrainer saves): config.json with one label
(`num_labels: 1`, the reward), safetensors weights, the tokenizer files. It is data, never code: weights load
from safetensors only (a folder holding only pickled weights is refused: unpickling runs code, `safe_weights`),
with trust_remote_code off, and a folder whose config.json or tokenizer_config.json has an `auto_map` (code of
its own) is refused before anything loads, with the entry that names the code.

Scoring: each (prompt, completion) is rendered through the reward model's own chat template as a user turn
and an assistant turn (without a template: prompt + completion as one text, as TRL's reward models of plain
text read it), tokenized with its tokenizer (cut to its longest input, keeping the start), in batches of
`BATCH_SIZE`, right-padded, under `torch.no_grad()`; the reward is the model's one logit, as a float. The
model sits on the current CUDA device when there is one (in its saved dtype), else on the CPU (in fp32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import ConfigError
from zerofit.levers.kernels import hub_kernels_off
from zerofit.models.hub import remote_code
from zerofit.models.safe_weights import safetensors_only
from zerofit.objectives.grpo.rewards import RewardFn

__all__ = ["BATCH_SIZE", "RewardModel", "check_reward_model_folder", "reward_model"]

BATCH_SIZE = 16  # completions per reward-model forward


def _refuse(folder: Path, why: str) -> ConfigError:
    return ConfigError([f"rl.rewards: reward_model path {folder}: {why}"])


def check_reward_model_folder(folder: Path) -> dict[str, Any]:
    """config.json of a reward-model folder that loads as data (safetensors, no code, one label); a
    ConfigError naming the folder, the reason and the fix otherwise. Nothing is imported or unpickled."""
    if not (folder / "config.json").is_file():
        raise _refuse(folder, "not a model folder (no config.json); point path at a sequence-classification "
                      "model folder, e.g. the `zerofit export` of a reward-model run")  # fmt: skip
    found = remote_code(str(folder))
    if found:
        raise _refuse(folder, f"it needs Python code of its own to load ({found[0].describe()}), and zerofit "
                      "never runs a reward model's code (trust_remote_code stays off); use a folder of a model "
                      "type transformers ships, without auto_map")  # fmt: skip
    if not safetensors_only(folder, f"rl.rewards: reward_model path {folder}"):  # pickles only: refused there
        raise _refuse(folder, "no weights; zerofit loads a reward model from safetensors only (model.safetensors): "
                      "save it with save_pretrained(safe_serialization=True)")  # fmt: skip
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    # save_pretrained writes id2label (num_labels is derived from it); transformers' default is 2 labels
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if labels != 1:
        raise _refuse(folder, f"its classifier has {labels} labels, and a reward model scores with one "
                      "(num_labels: 1, as TRL's RewardTrainer and zerofit's reward-model runs train it)")  # fmt: skip
    return config


class RewardModel:
    """A loaded reward model and its tokenizer; `score` gives one float per (prompt, completion)."""

    def __init__(self, folder: str | Path, device: torch.device | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.folder = Path(folder).expanduser()
        check_reward_model_folder(self.folder)
        if device is None:
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = "auto" if device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder, trust_remote_code=False)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.folder, use_safetensors=True, trust_remote_code=False, dtype=dtype, **hub_kernels_off()
        )
        self.model.to(device).eval()
        self.device = device
        if self.tokenizer.pad_token_id is None:  # padding needs one; the classifier reads the last real token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        # The longest input it reads: its positions (a tokenizer may say "no limit" with a huge number).
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = min(int(self.tokenizer.model_max_length), int(positions or sys.maxsize))

    def render(self, prompt: str, completion: str) -> str:
        """The text the reward model reads: a user and an assistant turn through its chat template, or the
        prompt followed by the completion without one."""
        if getattr(self.tokenizer, "chat_template", None):
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return str(self.tokenizer.apply_chat_template(turns, tokenize=False))
        return prompt + completion

    @torch.no_grad()
    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One reward per completion: the model's logit, in batches of `BATCH_SIZE`."""
        texts = [self.render(p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for start in range(0, len(texts), BATCH_SIZE):
            enc = self.tokenizer(
                texts[start : start + BATCH_SIZE],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=not getattr(self.tokenizer, "chat_template", None),
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            out.extend(logits[:, 0].float().cpu().tolist())
        return out


def reward_model(path: str, device: torch.device | None = None) -> RewardFn:
    """The reward function of the reward model in folder `path` (loaded now, once)."""
    model = RewardModel(path, device)

    def reward(prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float]:
        return model.score(prompts, completions)

    return reward
