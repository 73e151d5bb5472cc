"""What a run of an objective that generates its sequences (GRPO's, `zerofit.objectives.grpo`) assembles
beyond the others: its prompt data (and held-out prompts) and its rollouts.

`zerofit.recipe.assembly` calls these where it builds a preference or SFT run's data. The reward
functions are built (and a `module:function` imported) only by `rollouts`, which only a training launch's
`PreparedRun.loop_inputs` calls: `zerofit plan`, `export` and `generate` of a run folder never reach it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from zerofit.config.batching import BatchSplit
from zerofit.config.schema import ZerofitConfig
from zerofit.data import GlobalBatchSampler, eval_source, hold_out
from zerofit.data.prompts import PromptExample, load_prompts
from zerofit.data.sft import DataStats, TokenizedData
from zerofit.data.vision_prompts import load_vision_prompts
from zerofit.loop.rollout import Rollouts, SamplingSettings
from zerofit.objectives.grpo import ENVIRONMENT_REWARD
from zerofit.objectives.grpo.rewards import score_completions
from zerofit.recipe.rewards import build_rewards
from zerofit.recipe.tools import build_agent

__all__ = ["end_ids", "load_prompt_data", "rollouts"]


HeldOut = TokenizedData[PromptExample]  # held-out prompts (their `records`: each prompt's data record)


def _prompts(cfg: ZerofitConfig, tokenizer: Any, processor: Any, path: str, split: str, key: str) -> HeldOut:
    """The prompts of one source, cut to rl.max_prompt_length by data.truncation; with a vision-language
    model's `processor`, image prompts (`zerofit.data.vision_prompts`), never cut."""
    d, limit = cfg.data, cfg.rl.max_prompt_length
    if processor is not None:
        data = load_vision_prompts(path, processor, limit, split=split, subset=d.subset, key=key)
    else:
        data = load_prompts(
            path, tokenizer, limit, split=split, subset=d.subset, key=key, truncation=d.truncation
        )
    return TokenizedData(data.prompts, data.stats, [p.record for p in data.prompts])


def load_prompt_data(
    cfg: ZerofitConfig, tokenizer: Any, processor: Any = None
) -> tuple[list[PromptExample], DataStats, GlobalBatchSampler, HeldOut | None]:
    """The prompts of data.path (every rank reads them: no tokenized cache), the sampler of the prompt order
    (rl.prompts_per_step prompts per step, the data's own epochs and shuffle), and the held-out prompts the
    evaluation answers: data.eval_path's, data.eval_split's split of data.path, or its fraction of data.path's
    records (`zerofit.data.holdout`, kept out of training); None without evaluation data. `processor`: a
    vision-language model's (image prompts), else None."""
    d = cfg.data
    train = _prompts(cfg, tokenizer, processor, d.path, d.split, "data.path")
    held: HeldOut | None = None
    source = eval_source(d)
    if source is not None:
        held = _prompts(cfg, tokenizer, processor, *source)
    elif d.eval_split is not None:
        train, held = hold_out(train, d.eval_split, cfg.seed)
    sampler = GlobalBatchSampler(
        len(train.examples), cfg.rl.prompts_per_step, cfg.seed, d.shuffle, cfg.train.partial_window
    )
    return train.examples, train.stats, sampler, held


def end_ids(tokenizer: Any, model_config: Any) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's eos and the generation config's (a chat model's
    turn end)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    ids.update([extra] if isinstance(extra, int) else list(extra or []))
    return tuple(sorted(ids))


def rollout_fields(
    cfg: ZerofitConfig,
    tokenizer: Any,
    model: Any,
    prompts: list[PromptExample],
    sampler: GlobalBatchSampler,
    batch: BatchSplit,
) -> dict[str, Any]:
    """What every run that samples inside its steps (GRPO and RLOO's `Rollouts`, distillation's) takes alike:
    its prompts and their sampler, the batch split, G, sampling per `rl.*`, the decoder and the seed."""
    rl = cfg.rl
    sampling = SamplingSettings(
        max_new_tokens=rl.max_completion_length,
        eos_ids=end_ids(tokenizer, model),
        pad_id=int(tokenizer.pad_token_id),
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
    )

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return {
        "prompts": prompts,
        "sampler": sampler,
        "batch": batch,
        "group_size": rl.num_generations,
        "sampling": sampling,
        "decode": decode,
        "seed": cfg.seed,
        "log_completions_every": rl.log_completions_every,
    }


def rollouts(
    cfg: ZerofitConfig,
    tokenizer: Any,
    model: Any,
    prompts: list[PromptExample],
    sampler: GlobalBatchSampler,
    batch: BatchSplit,
    estimator: Callable[[Any, int], Any],
    penalty: Callable[..., Any] | None = None,
) -> Rollouts:
    """The run's `Rollouts`: its reward functions built now (the user's own config names them; a launch is
    the only caller), sampling per `rl.*`, the advantages by the objective's `estimator` (after its reward
    `penalty`, if any); with tools or an environment, the multi-turn agent."""
    rl = cfg.rl
    rewards = build_rewards(rl.rewards, tokenizer, required=rl.environment is None)
    fields = rollout_fields(cfg, tokenizer, model, prompts, sampler, batch)
    return Rollouts(
        **fields,
        score=functools.partial(score_completions, rewards),
        estimator=estimator,
        penalty=penalty,
        mask_truncated=rl.mask_truncated_completions,
        old_logps=rl.num_iterations > 1,
        temperature=rl.temperature,
        cross_entropy=cfg.train.cross_entropy,
        reward_names=tuple(r.name for r in rewards) + ((ENVIRONMENT_REWARD,) if rl.environment else ()),
        agent=build_agent(rl, tokenizer, fields["sampling"].eos_ids, fields["decode"], prompts, cfg.seed),
    )
