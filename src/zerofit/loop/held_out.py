"""An RL run's held-out reward: the policy answers the held-out prompts, the run's rewards score the answers.

    held_out_rewards: the held-out prompts in windows of `per_rank` x dp -> each rank its `per_rank` of
                      every window (a rank whose share of the last window is empty samples one dummy row,
                      discarded: every rank runs the same sampling calls, so FSDP2's gathers stay matched)
                      -> sampled by the rollout's own sampler (`zerofit.loop.rollout.sample_completions`,
                      one completion per prompt) -> scored by the run's reward functions (a failure stops
                      every rank with its paragraph, as in training) -> one all-reduce of a [fields, P]
                      table -> means over every held-out prompt.

`eval.sampling` says how a prompt is answered: `seeded` samples with the run's `rl.temperature` / `top_p`
/ `top_k`, from one seed per held-out prompt (`completion_seed(seed, EVAL_STEP, prompt)`), the same seed at
every evaluation, so two evaluations differ only by the policy; `greedy` takes the most likely token each
time (top-k 1 of the same sampler). Either way a prompt's completion does not depend on the split (each row
has its own noise, as in a rollout), so `eval/reward` is the same on one process and on several ranks.

The fields (`eval/` and the training rollout's names): `eval/reward` (the weighted sum of the rewards, its
mean over the held-out prompts: what the best checkpoint and early stopping follow for an RL objective,
`zerofit.checkpoint.policy.followed_metric`), `eval/reward_std`, `eval/rewards/<function>` (each function's
mean), `eval/completions/mean_length`, `eval/completions/truncated_fraction` and `eval/prompts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from zerofit.loop.rollout import (
    PromptRow,
    Rollouts,
    Sampled,
    completion_seed,
    generating,
    reward_table,
    sample_completions,
)
from zerofit.loop.vision_rollout import images_of
from zerofit.metrics.keys import EVAL_REWARD
from zerofit.strategies.base import Strategy

__all__ = ["EVAL_STEP", "GREEDY", "held_out_rewards"]

EVAL_STEP = -1  # `completion_seed`'s step of the held-out prompts: no training step has it
GREEDY = "greedy"  # eval.sampling's value for the most likely token each time (else `seeded`)


def _my_windows(n: int, per_rank: int, dp: int, rank: int) -> list[list[int]]:
    """This rank's prompt indices of each window of `per_rank` x `dp` held-out prompts (the last window's
    share may be short or empty)."""
    window = per_rank * dp
    return [
        list(range(start + rank * per_rank, min(start + (rank + 1) * per_rank, n)))
        for start in range(0, n, window)
    ]


def _sample_mine(
    strategy: Strategy,
    rollouts: Rollouts,
    prompts: Sequence[PromptRow],
    windows: list[list[int]],
    greedy: bool,
) -> list[Sampled]:
    """This rank's completions of its windows' prompts, in order; an empty share samples prompt 0 once (every
    rank samples as many times, with at least one row), its completion dropped."""
    settings = rollouts.sampling
    if greedy:
        settings = dataclasses.replace(settings, temperature=1.0, top_p=1.0, top_k=1)
    out: list[Sampled] = []
    with generating(strategy) as policy:
        for mine in windows:
            rows = mine or [0]
            seeds = [completion_seed(rollouts.seed, EVAL_STEP, i) for i in rows]
            ids = [prompts[i].input_ids for i in rows]
            images = [images_of(prompts[i]) for i in rows]
            pixels = images if any(images) else None  # image prompts (a vision-language model)
            sampled = sample_completions(policy, ids, seeds, settings, strategy.device, None, pixels)  # type: ignore[arg-type]
            out.extend(sampled if mine else [])
    return out


def held_out_rewards(
    strategy: Strategy,
    rollouts: Rollouts,
    prompts: Sequence[PromptRow],
    per_rank: int,
    steps_done: int,
    sampling: str = "seeded",
) -> dict[str, Any]:
    """The `eval/*` reward fields of the policy over every held-out prompt of `prompts` (collective: every
    rank calls it with the same prompts); `per_rank`: prompts a rank samples at once (the training rollout's
    completions per rank), `steps_done`: the step a reward error names, `sampling`: `eval.sampling`."""
    n, dp, rank = len(prompts), strategy.dp_world_size, strategy.dp_rank
    windows = _my_windows(n, per_rank, dp, rank)
    sampled = _sample_mine(strategy, rollouts, prompts, windows, sampling == GREEDY)
    flat = [i for mine in windows for i in mine]
    texts = [rollouts.decode(s.ids) for s in sampled]
    weighted, each = rollouts.agreed_score([prompts[i] for i in flat], texts, steps_done, strategy)
    names = rollouts.reward_names
    local = reward_table(flat, n, weighted, each, names, sampled)
    table = strategy.all_reduce_sum(local.to(strategy.device)).cpu()
    reward = table[0]
    return {
        EVAL_REWARD: float(reward.mean()),
        "eval/reward_std": float(reward.std()) if n > 1 else 0.0,
        **{f"eval/rewards/{name}": float(table[1 + k].mean()) for k, name in enumerate(names)},
        "eval/completions/mean_length": float(table[-3].mean()),
        "eval/completions/truncated_fraction": float(table[-2].mean()),
        "eval/prompts": n,
    }
