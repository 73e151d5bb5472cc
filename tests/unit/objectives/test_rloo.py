"""RLOO's rules: GRPO's loss keys, and rl.beta > 0 (its KL penalty is not implemented yet), are refused
with train.objective rloo, RLOO's rl.normalize_advantages with grpo, each in its paragraph naming the key; the
plan names the leave-one-out baseline. (Its loss against TRL's: test_rloo_trl.py.)"""

from __future__ import annotations

import pytest

from config_helpers import REPO
from zerofit.config import load_config
from zerofit.core.errors import ConfigError
from zerofit.resolution import resolve

REWARD = "rl.rewards=[{function: length, target_length: 3}]"
BATCH = "batch.global_batch_size=null"


def _problems(objective: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(
            load_config(REPO / "configs" / "demo.yaml", [f"train.objective={objective}", REWARD, *overrides]),
            1,
        )
    return str(err.value)


def test_rloo_refuses_grpos_loss_keys_and_the_kl_penalty() -> None:
    text = _problems(
        "rloo", "rl.scale_rewards=batch", "rl.importance_sampling_level=sequence", "rl.beta=0.05"
    )
    assert "rl.scale_rewards = 'batch' with train.objective = 'rloo', which does not read it" in text
    assert "rl.importance_sampling_level = 'sequence' with train.objective = 'rloo'" in text
    assert "unset rl.scale_rewards" in text and "rl.normalize_advantages" in text
    assert "rl.beta = 0.05 with train.objective = 'rloo'" in text and "set rl.beta=0" in text


def test_grpo_refuses_rloos_key() -> None:
    text = _problems("grpo", "rl.normalize_advantages=true")
    assert "rl.normalize_advantages = True with train.objective = 'grpo', which does not read it" in text
    assert "rl.scale_rewards" in text


def test_rloo_resolves_and_describes_its_estimator() -> None:
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        ["train.objective=rloo", REWARD, BATCH, "rl.normalize_advantages=true"],
    )
    plan = resolve(cfg, 1)
    text = plan.objective.describe(plan.config, "none")
    assert text is not None and text.startswith("rloo (leave-one-out baseline, normalized over the batch")
