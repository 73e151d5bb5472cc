"""The GRPO parts of a run (`train.objective: grpo`): its objective, its prompt data and its rollouts.

`zerofit.recipe.assembly` calls these where it builds a preference or SFT run's counterparts. The reward
functions are built (and a `module:function` imported) only by `rollouts`, which only a training launch's
`PreparedRun.loop_inputs` calls: `zerofit plan`, `export` and `generate` of a run folder never reach it.
"""

from __future__ import annotations

import functools
from typing import Any

from zerofit.config.batching import BatchSplit
from zerofit.config.schema import ZerofitConfig
from zerofit.data import GlobalBatchSampler
from zerofit.data.prompts import PromptExample, load_prompts
from zerofit.data.sft import DataStats
from zerofit.loop.rollout import Rollouts, SamplingSettings
from zerofit.objectives.grpo import GRPOObjective, GRPOSettings
from zerofit.objectives.rewards import score_completions
from zerofit.recipe.rewards import build_rewards, describe_reward

__all__ = ["describe_grpo", "end_ids", "grpo_objective", "load_prompt_data", "optimizer_steps", "rollouts"]


def grpo_objective(cfg: ZerofitConfig) -> GRPOObjective:
    """The loss of the `rl` section (`zerofit.objectives.grpo`)."""
    rl = cfg.rl
    return GRPOObjective(
        GRPOSettings(
            loss_type=rl.loss_type,
            beta=rl.beta,
            epsilon=rl.epsilon,
            epsilon_high=rl.epsilon_high,
            max_completion_length=rl.max_completion_length,
            temperature=rl.temperature,
        )
    )


def describe_grpo(cfg: ZerofitConfig) -> str:
    """The plan's objective line for GRPO: the loss, the global batch in prompts, completions and tokens (the
    batch rule), the updates per rollout and every reward function (a `module:function` is named, not
    imported)."""
    rl = cfg.rl
    n = rl.num_generations * rl.prompts_per_step
    normalizer = {
        "grpo": "each completion's token mean, averaged over the global batch's completions",
        "dapo": "the global batch's completion tokens",
        "dr_grpo": f"{n} completions x rl.max_completion_length {rl.max_completion_length}",
    }[rl.loss_type]
    high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
    reference = "the base with the LoRA adapters off" if rl.beta > 0 else "none (beta 0)"
    return (
        f"grpo ({rl.loss_type}, beta {rl.beta:g}, clip [1 - {rl.epsilon:g}, 1 + {high:g}], advantages / std of "
        f"the {rl.scale_rewards}): {rl.prompts_per_step} prompts x G {rl.num_generations} = {n} completions per "
        f"step, <= {rl.max_prompt_length} + {rl.max_completion_length} tokens each (<= "
        f"{n * rl.max_completion_length:,} completion tokens), sampled by the policy (temperature "
        f"{rl.temperature:g}, top_p {rl.top_p:g}, top_k {rl.top_k}); {rl.num_iterations} update(s) per rollout; "
        f"loss over {normalizer}; reference: {reference}; rewards: "
        + "; ".join(describe_reward(spec) for spec in rl.rewards)
    )


def describe_rl_tokens(cfg: ZerofitConfig) -> str:
    """The plan's tokens-per-step line for GRPO: `16 completions x (<= 256 prompt + <= 6 completion tokens)
    = <= 4,192 tokens, <= 96 of them trained`."""
    rl = cfg.rl
    n = rl.num_generations * rl.prompts_per_step
    whole = n * (rl.max_prompt_length + rl.max_completion_length)
    return (
        f"{n} completions x (<= {rl.max_prompt_length} prompt + <= {rl.max_completion_length} completion tokens) "
        f"= <= {whole:,} tokens, <= {n * rl.max_completion_length:,} of them trained"
    )


def optimizer_steps(cfg: ZerofitConfig) -> int:
    """The optimizer steps the schedule spans: train.max_steps, times rl.num_iterations for GRPO (each loop
    step takes that many optimizer steps on its rollout)."""
    assert cfg.train.max_steps is not None, "a run plan knows its step count"
    return cfg.train.max_steps * (cfg.rl.num_iterations if cfg.train.objective == "grpo" else 1)


def load_prompt_data(
    cfg: ZerofitConfig, tokenizer: Any
) -> tuple[list[PromptExample], DataStats, GlobalBatchSampler]:
    """The prompts of data.path (every rank reads them: no tokenized cache), and the sampler of the prompt
    order: rl.prompts_per_step prompts per step, the data's own epochs and shuffle."""
    d = cfg.data
    data = load_prompts(
        d.path, tokenizer, cfg.rl.max_prompt_length, split=d.split, subset=d.subset, truncation=d.truncation
    )
    sampler = GlobalBatchSampler(
        len(data.prompts), cfg.rl.prompts_per_step, cfg.seed, d.shuffle, cfg.train.partial_window
    )
    return data.prompts, data.stats, sampler


def end_ids(tokenizer: Any, model_config: Any) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's eos and the generation config's (a chat model's
    turn end)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    ids.update([extra] if isinstance(extra, int) else list(extra or []))
    return tuple(sorted(ids))


def rollouts(
    cfg: ZerofitConfig,
    tokenizer: Any,
    model: Any,
    prompts: list[PromptExample],
    sampler: GlobalBatchSampler,
    batch: BatchSplit,
) -> Rollouts:
    """The run's `Rollouts`: its reward functions built now (the user's own config names them; a launch is
    the only caller), sampling per `rl.*`."""
    rl = cfg.rl
    rewards = build_rewards(rl.rewards, tokenizer)
    sampling = SamplingSettings(
        max_new_tokens=rl.max_completion_length,
        eos_ids=end_ids(tokenizer, model),
        pad_id=int(tokenizer.pad_token_id),
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
    )
    return Rollouts(
        prompts=prompts,
        sampler=sampler,
        batch=batch,
        group_size=rl.num_generations,
        sampling=sampling,
        score=functools.partial(score_completions, rewards),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        seed=cfg.seed,
        scale_rewards=rl.scale_rewards,
        mask_truncated=rl.mask_truncated_completions,
        old_logps=rl.num_iterations > 1,
        temperature=rl.temperature,
        cross_entropy=cfg.train.cross_entropy,
        reward_names=tuple(r.name for r in rewards),
        log_completions_every=rl.log_completions_every,
    )
