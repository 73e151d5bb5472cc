"""RLOO's rules: GRPO's loss keys are refused with train.objective rloo, RLOO's rl.normalize_advantages with grpo, each in its paragraph naming the key; the
plan names the leave-one-out baseline. (Its loss against TRL's: test_rloo_trl.py.)"""

from __future__ import annotations

from pathlib import Path

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
    assert "rl.beta" not in text  # RLOO's KL in the reward, TRL's (test_rloo_trl.py)


def test_grpo_refuses_rloos_key() -> None:
    text = _problems("grpo", "rl.normalize_advantages=true")
    assert "rl.normalize_advantages = True with train.objective = 'grpo', which does not read it" in text
    assert "rl.scale_rewards" in text


def test_rloo_resolves_and_describes_its_estimator() -> None:
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        ["train.objective=rloo", REWARD, BATCH, "rl.normalize_advantages=true", "rl.beta=0.05"],
    )
    plan = resolve(cfg, 1)
    text = plan.objective.describe(plan.config, "none")
    assert text is not None and text.startswith("rloo (leave-one-out baseline, normalized over the batch")
    assert "rewards minus 0.05 x the summed log-ratio to the reference" in text


@pytest.mark.slow
def test_an_rloo_run_with_beta_logs_the_kl_of_its_reward_penalty(tmp_path: Path) -> None:
    """rl.beta > 0 reaches the rollout (the assembly passes the objective's `reward_penalty`): 2 steps of a
    LoRA run on the demo prompts in this process; at step 1 the adapters are still zero (the policy is the
    reference: kl 0), at step 2 they are not."""
    import json

    from zerofit.recipe import run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"item {i}: "}) + "\n" for i in range(8)))
    args = [
        f"output_dir={tmp_path}",
        "run_name=rloo",
        "distributed.strategy=single",
        "distributed.preset=null",
        "train.objective=rloo",
        "train.max_steps=2",
        "train.precision=fp32",
        BATCH,
        "batch.micro_batch_size=4",
        "rl.num_generations=4",
        "rl.prompts_per_step=2",
        "rl.max_completion_length=4",
        "rl.beta=0.05",
        REWARD,
        f"data.path={prompts}",
        "data.eval_split=null",
        "checkpoint.every_steps=0",
        "logging.console=false",
        "logging.wandb.mode=disabled",
    ]
    assert run.main(["--config", "configs/demo.yaml", *args]) == 0
    rows = [json.loads(line) for line in (tmp_path / "rloo" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert abs(rows[1]["kl"]) > 1e-6 and all(r["grad_norm"] > 0 for r in rows)
