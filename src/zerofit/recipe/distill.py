"""What an on-policy distillation run (`train.objective: gkd`) assembles beyond GRPO's prompts: the data's
completions (tokenized once) and its rollouts (`zerofit.loop.distill`).

The data is GRPO's prompt data (`zerofit.recipe.rl.load_prompt_data`), with a `completion` column (TRL's
prompt-completion layout: the text that follows the prompt) read where a completion is off-policy: with
`gkd.lmbda` < 1 and without `gkd.seq_kd`, every record must have one (refused in one paragraph naming the
first record without). A completion is its tokens then the tokenizer's eos, its first rl.max_completion_length
tokens kept.
"""

from __future__ import annotations

from typing import Any

from zerofit.config.batching import BatchSplit
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import DataError
from zerofit.data import GlobalBatchSampler
from zerofit.data.prompts import PromptExample
from zerofit.loop.distill import DistillRollouts, no_rewards
from zerofit.recipe.rl import rollout_fields

__all__ = ["COMPLETION_KEY", "data_completions", "distill_rollouts"]

COMPLETION_KEY = "completion"  # TRL's prompt-completion column


def data_completions(
    cfg: ZerofitConfig, tokenizer: Any, prompts: list[PromptExample]
) -> list[list[int] | None] | None:
    """Each record's completion ids (None where it has none), or None when no completion is ever read
    (lmbda 1, or seq_kd); a record without one is refused when some completion is off-policy."""
    g = cfg.gkd
    if g.lmbda >= 1 or g.seq_kd:
        return None
    out: list[list[int] | None] = [None] * (max(p.record for p in prompts) + 1)
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    for p in prompts:
        text = p.columns.get(COMPLETION_KEY)
        if not isinstance(text, str) or not text.strip():
            raise DataError(
                f"{cfg.data.path}: record {p.record + 1} has no {COMPLETION_KEY!r} text, and with "
                f"train.objective = 'gkd', gkd.lmbda = {g.lmbda:g} (< 1) and gkd.seq_kd false a completion is the "
                f"data's with probability {1 - g.lmbda:g}; add a {COMPLETION_KEY!r} to every record, or set "
                "gkd.lmbda=1 (the student's samples only) or gkd.seq_kd=true (the teacher's)"
            )
        ids = tokenizer.encode(text, add_special_tokens=False) + eos
        out[p.record] = ids[: cfg.rl.max_completion_length]
    return out


def distill_rollouts(
    cfg: ZerofitConfig,
    tokenizer: Any,
    model: Any,
    prompts: list[PromptExample],
    sampler: GlobalBatchSampler,
    batch: BatchSplit,
    teacher: Any,
) -> DistillRollouts:
    """The run's `DistillRollouts`: sampling per `rl.*`, the coin per `gkd.lmbda`, the data's completions."""
    g = cfg.gkd
    return DistillRollouts(
        **rollout_fields(cfg, tokenizer, model, prompts, sampler, batch),
        score=no_rewards,
        completions=data_completions(cfg, tokenizer, prompts),
        teacher=teacher,
        lmbda=g.lmbda,
        seq_kd=g.seq_kd,
    )
