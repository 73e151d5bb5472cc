"""`zerofit score`: a trained reward model's scalar reward for one (prompt, response).

The pair is encoded exactly as training encoded a preference pair's chosen sequence
(`zerofit.data.preference.tokenize_pair`: strings as [bos] + prompt + response + [eos]; with `chat` the
prompt a user turn and the response an assistant turn through the chat template), cut to the run's
`data.max_seq_len`, and the reward is the score head's one output at the last token
(`zerofit.objectives.reward_model.loss.pair_rewards`).

    a run directory   the reward model rebuilt from config.yaml + its newest weights (or `--step N`)
    an export         a `zerofit export` folder of a reward run (merged or full): transformers'
                      AutoModelForSequenceClassification loads it, as any other tool would

A saved config is data: nothing in a run or export folder turns on remote code (`trust_remote_code` only
with the user's own flag).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import CONFIG_FILE, EXPORT_INFO
from zerofit.data.formats import Preference
from zerofit.data.preference import tokenize_pair
from zerofit.levers.kernels import hub_kernels_off
from zerofit.models.hub import hub_errors
from zerofit.models.safe_weights import check_zerofit_folder, safetensors_only
from zerofit.objectives.registry import objective_of, saved_objective
from zerofit.objectives.reward_model.loss import pair_rewards
from zerofit.trained.model import load_trained

__all__ = ["Scorer", "load_scorer"]


@dataclass
class Scorer:
    """A reward model, its tokenizer and the sequence length its run trained at."""

    model: Any
    tokenizer: Any
    max_seq_len: int

    def input_ids(self, prompt: str, response: str, chat: bool = False) -> list[int]:
        """The tokens training would have scored for `response` as the chosen answer to `prompt`."""
        if chat:
            record = Preference(
                [{"role": "user", "content": prompt}],
                [{"role": "assistant", "content": response}],
                [{"role": "assistant", "content": response + " "}],
            )
        else:
            record = Preference(prompt, response, response + " ")
        pair, _, _ = tokenize_pair(self.tokenizer, record, self.max_seq_len, "--prompt / --response")
        return pair.chosen.input_ids

    @torch.no_grad()
    def __call__(self, prompt: str, response: str, chat: bool = False) -> float:
        """The scalar reward of `response` to `prompt`."""
        ids = torch.tensor([self.input_ids(prompt, response, chat)])
        return float(pair_rewards(self.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})[0])


def _not_reward(path: Path, objective: Any) -> ConfigError:
    return ConfigError(
        [
            f"{path} was trained with train.objective = {objective!r}, not 'reward': it has no score head to give "
            "a reward. Score with a reward model's run or export (train.objective: reward), or try this one "
            f'with zerofit generate {path} --prompt "..."'
        ]
    )


def _from_export(path: Path, trust_remote_code: bool) -> Scorer:
    """A reward run's `zerofit export` folder (merged or full), loaded by transformers alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    info_file = path / EXPORT_INFO
    if info_file.is_file():  # zerofit wrote it: no pickle belongs there (`models.safe_weights`)
        check_zerofit_folder(path, "a zerofit export")
    info = json.loads(info_file.read_text(encoding="utf-8")) if info_file.is_file() else {}
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    objective = (config.get("train") or {}).get("objective")
    spec = saved_objective(objective)
    if spec is None or not spec.score_head or info.get("kind") == "adapter":
        if spec is None or not spec.score_head:
            raise _not_reward(path, objective)
        raise ConfigError(
            [
                f"{path} is a LoRA adapter export; export the run with --merge (a sequence-classification "
                "folder) or score the run directory itself"
            ]
        )
    safe = safetensors_only(path, str(path))
    with hub_errors(str(path), "weights"):
        model = AutoModelForSequenceClassification.from_pretrained(
            path, trust_remote_code=trust_remote_code, **hub_kernels_off(), **safe
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    max_seq_len = int((config.get("data") or {}).get("max_seq_len") or sys.maxsize)
    return Scorer(model.eval(), tokenizer, max_seq_len)


def load_scorer(
    path: Path,
    *,
    step: int | None = None,
    trust_pickles: bool = False,
    trust_remote_code: bool = False,
) -> Scorer:
    """The reward model of a run directory (its newest weights, or checkpoint `step`) or of an export."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        if step is not None:
            raise ConfigError([f"--step {step}: only for a run directory, and {path} has no {CONFIG_FILE}"])
        return _from_export(path, trust_remote_code)
    trained = load_trained(path, step=step, trust_pickles=trust_pickles, trust_remote_code=trust_remote_code)
    cfg = trained.run.config
    if not objective_of(cfg).score_head:
        raise _not_reward(path, cfg.train.objective)
    return Scorer(trained.model, trained.tokenizer, cfg.data.max_seq_len)
