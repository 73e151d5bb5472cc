"""GRPO rollouts inside the run: the policy samples, the rewards score, the advantages come from whole groups.

One rollout per loop step `step` (`Rollouts.step_batches`):

    1. The global batch's prompts are the sampler's `rl.prompts_per_step` prompt indices of `step`; global
       completion c (0 .. G x prompts - 1) answers prompt c // G, so group g is completions gG .. gG + G - 1.
    2. This rank's completions are `split_global_batch` of 0 .. N - 1 (the split of any global batch: micro
       x accumulation x data-parallel), and this rank samples them (`sample_completions`): eval mode, no
       grad, adapters on, the model's KV cache, and one torch.Generator per completion seeded from
       (seed, step, c), so completion c is the same tokens whatever the split, and a resumed run samples
       what the uninterrupted one did.
    3. This rank scores its completions (`Scorer`), and one all-reduce of a [fields, N] table (each rank
       fills its own columns) gives every rank every completion's rewards, length and truncation.
    4. The rank's micro-batches (`micro_batch`), with the old policy's per-token log-probs when
       `rl.num_iterations` > 1 (one no-grad forward per micro-batch, before any update); then the advantages,
       from whole groups even when a group's completions landed on several micro-batches or ranks, identically
       on every rank: the objective's `estimator` (GRPO's `group_advantages`, RLOO's leave-one-out baseline)
       of the rewards less the objective's `penalty`, if any (RLOO's KL, all-reduced like the table).

Sampling is a short loop over the model's forward with its KV cache rather than `generate`: generate draws a
whole batch's tokens from one generator, so a completion would depend on its batch neighbours. Here each
completion draws all its noise up front, in ONE call on its own generator (`draw_noise`: [tokens, vocab]
Exp(1) values), and every token of every row is then one batched operation: argmax(probs / noise), which
is exactly what `torch.multinomial(probs, 1, generator)` computes for one row (its one-sample path; the CPU
generator hands out the same values in one call as in one call per token), so a seed samples the tokens it
sampled when each token was one multinomial call per row. A row that ends (eos) leaves the batch and its
KV cache; a group's G rows share their prompt's prefill (run once per distinct prompt). Positions are
counted over real tokens (`position_ids` from the mask), as in the training forward, so left padding
changes nothing. Old log-probs (`rl.num_iterations` > 1) are recomputed by the loss's own forward, not
taken from the sampler's: the cached incremental forward rounds differently, and the ratio must be 1 at
the first update. The policy samples through the engine's bare module (`generating`): under FSDP2 every
layer is gathered once per rollout, not once per token; ZeRO-3 is refused by `zerofit.config.resolve` (its
hooks would gather every layer again for each token).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from zerofit.checkpoint.failed_save import error_parts, rebuild_error
from zerofit.config.batching import BatchSplit
from zerofit.core.errors import ZerofitError
from zerofit.core.progress import Progress, progress
from zerofit.data import GlobalBatchSampler, split_global_batch
from zerofit.loop.turns import Agent, agent_metrics
from zerofit.loop.vision_rollout import batch_images, images_of, prefixed, rope_positions
from zerofit.metrics.keys import REWARD
from zerofit.objectives.grpo import ENVIRONMENT_REWARD
from zerofit.objectives.grpo.loss import group_advantages, grpo_inputs, policy_logps
from zerofit.strategies.base import Strategy
from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = [
    "COMPLETIONS_FILE",
    "COMPLETIONS_TABLE",
    "MESSAGES_COLUMN",
    "PromptRow",
    "RewardFailed",
    "Rollouts",
    "SamplingSettings",
    "Scorer",
    "agree_on_failure",
    "completion_seed",
    "decode_step",
    "micro_batch",
    "reward_table",
    "sample_completions",
]

COMPLETIONS_FILE = "completions.jsonl"  # in the run folder: a few sampled completions every N steps
COMPLETIONS_TABLE = "completions"  # the same rows' table in the metrics sinks (W&B: a wandb.Table)
MESSAGES_COLUMN = (
    "messages"  # a multi-turn rollout's whole conversation, as the rewards and completions.jsonl see it
)
NOISE_BYTES = 8 << 20  # the most sampling noise one completion holds at a time (`noise_block`)

# (prompts, completions, columns, step (1-based), data records) -> (weighted total [n], per function [n])
Scorer = Callable[
    [list[str], list[str], dict[str, list[Any]], int, list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


class PromptRow(Protocol):
    """One prompt of the data: its text (what a reward sees), its token ids, and its other columns."""

    text: str
    input_ids: list[int]
    columns: dict[str, Any]
    record: int  # its record in the data (0-based)
    messages: list[
        dict[str, Any]
    ]  # the prompt as messages (a multi-turn rollout renders them with the tools)


class RewardFailed(ZerofitError):
    """A reward function or an `rl.environment` failed on some rank: its paragraph, raised by every rank (said
    once)."""

    agreed = True


@dataclass(frozen=True)
class SamplingSettings:
    """`rl.*`'s sampling keys, and the tokens that end a completion."""

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class Sampled:
    """One completion: its tokens (the eos included), whether it hit max_new_tokens first, and the sum of
    its tokens' entropies under the sampling distribution (softmax(logits / temperature), TRL's entropy).
    A multi-turn trajectory (`zerofit.loop.turns`) also says which of its tokens the policy sampled
    (`trained`; the others are template and tool tokens, masked), its own prompt (the row's rendered with
    the tools), the last turn's text and the whole conversation (what the rewards read), its environment's
    reward, its `AGENT_FIELDS` figures and, if it failed (`zerofit.loop.turns`), why."""

    ids: list[int]
    truncated: bool
    entropy_sum: float
    trained: list[bool] | None = None
    prompt_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    env_reward: float = 0.0
    stats: torch.Tensor | None = None
    failure: str | None = None


def agree_on_failure(
    strategy: Strategy,
    failure: str | ZerofitError | None,
    error: Callable[[str], ZerofitError] = RewardFailed,
) -> None:
    """Every rank calls this with its own `failure` (a paragraph, an error, or None): when any rank failed,
    every rank raises the first failing rank's, `agreed`, so it is said once (rank 0) and no rank is left
    waiting in a collective the failed one never reaches. A paragraph is raised as `error`; an error (a
    launch's refusal: a tool module that does not import) as its own class, with its own paragraph
    (`checkpoint.failed_save.error_parts`: a ConfigError stays one). One all-reduce, and a gather on failure."""
    failed = strategy.all_reduce_sum(torch.tensor([int(failure is not None)], device=strategy.device))
    if int(failed.item()):
        told = error_parts(failure) if isinstance(failure, ZerofitError) else failure
        first = next(said for said in strategy.all_gather_object(told) if said)
        exc = error(first) if isinstance(first, str) else rebuild_error(*first)
        exc.agreed = True
        raise exc


def completion_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of global completion `index` of step `step` (64 bits of a hash: no collisions
    between nearby triples, unlike a linear mix)."""
    digest = hashlib.sha256(f"zerofit-grpo/{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside the top-k and the top-p nucleus at -inf (one token always kept)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(dim=-1) - torch.softmax(ordered, dim=-1)
        drop = (before > top_p).scatter(-1, order, before > top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _left_padded(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest: ids and mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def decode_step(
    model: torch.nn.Module,
    step_ids: torch.Tensor,
    mask: torch.Tensor,
    cache: Any,
    logits_to_keep: int = 0,
    images: dict[str, torch.Tensor] | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """One decoding step of a left-padded batch with the model's KV cache (None: the prompts' first step):
    each row's last-position logits, and the cache. Positions are counted over real tokens (from `mask`, which
    covers the cache and `step_ids`), as in the training forward, unless `positions` gives them (an image
    prompt's M-RoPE grid, `zerofit.loop.vision_rollout`); `images`: the prompts' image inputs; `logits_to_keep`
    1 computes the last position's logits only (0: every position's, as the rollout has always sampled)."""
    if positions is None:
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -step_ids.size(1) :]
    result = model(
        input_ids=step_ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        **({"logits_to_keep": logits_to_keep} if logits_to_keep else {}),
        **(images or {}),
    )
    return result.logits[:, -1], result.cache


@torch.no_grad()
def sample_completions(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    s: SamplingSettings,
    device: torch.device,
    shown: Progress | None = None,
    images: list[dict[str, torch.Tensor]] | None = None,
) -> list[Sampled]:
    """Sample one completion per prompt, each row from its own seeded noise (module docstring); `shown`
    counts the tokens sampled so far (out of `s.max_new_tokens`), for a rollout long enough to report;
    `images`: each prompt's image inputs (image prompts of a vision-language model), else None."""
    was_training = model.training
    model.eval()
    try:
        return _sample(model, prompts, seeds, s, device, shown, images)
    finally:
        model.train(was_training)


def noise_block(max_new_tokens: int, vocab: int) -> int:
    """How many tokens' noise a completion draws in one call: all of them, unless that would hold more than
    `NOISE_BYTES` per completion (a long completion over a large vocabulary), then blocks of that size."""
    return max(1, min(max_new_tokens, NOISE_BYTES // (4 * vocab)))


def draw_noise(gens: list[torch.Generator], tokens: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, tokens, vocab] fp32 Exp(1) noise, row i drawn from `gens[i]` in ONE call: the same values, on
    the CPU, as `tokens` successive `torch.multinomial(probs, 1, generator=gens[i])` calls would draw
    (multinomial's one-sample path is argmax(probs / Exp(1) noise)), so a seed samples what it always did."""
    noise = torch.empty((len(gens), tokens, vocab), dtype=torch.float32, device=device)
    for row, gen in zip(noise, gens, strict=True):
        row.exponential_(1.0, generator=gen)
    return noise


def _rows_selectable(cache: Any) -> bool:
    """Whether rows can be picked out of `cache` (`batch_select_indices`): a DynamicCache of plain or
    sliding-window attention layers. With other layers (linear attention's states, quantized) every row
    keeps its own prompt and stays in the batch when it finishes, its tokens no longer read."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    return (
        type(cache) is DynamicCache
        and bool(layers)
        and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)
    )


@dataclass
class _Batch:
    """The model's batch while sampling: its KV cache, attention mask (prompt, then one column per sampled
    token) and next positions; `where` is each still-sampling row's completion index and `rows` its row in
    the model's batch (None: the batch holds exactly those rows, finished ones having been dropped), `noise`
    their sampling noise."""

    where: torch.Tensor
    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor | None = None
    rope: torch.Tensor | None = None  # each row's M-RoPE offset (image prompts: `loop.vision_rollout`)
    noise: torch.Tensor | None = None  # [rows when drawn, tokens, vocab]
    noise_rows: torch.Tensor | None = None  # each still-sampling row's row of `noise` (None: the same rows)

    def draw(self, gens: list[torch.Generator], tokens: int, vocab: int) -> None:
        """The still-sampling rows' noise for the next `tokens` tokens (`draw_noise`)."""
        self.noise = draw_noise([gens[i] for i in self.where.tolist()], tokens, vocab, self.mask.device)
        self.noise_rows = None

    def step_noise(self, token: int) -> torch.Tensor:
        """The still-sampling rows' noise of the block's `token`-th token ([rows, vocab])."""
        assert self.noise is not None
        return self.noise[:, token] if self.noise_rows is None else self.noise[self.noise_rows, token]

    def keep(self, kept: torch.Tensor) -> None:
        """Keep sampling only the rows `kept` (a bool per still-sampling row): the others leave the model's
        batch and its cache (or, where the cache cannot drop rows, are no longer read); their noise stays
        where it is (no copy), no longer read."""
        index = kept.nonzero().view(-1)
        self.where = self.where[index]
        if self.noise is not None:
            every = torch.arange(self.noise.size(0), device=index.device)
            self.noise_rows = (every if self.noise_rows is None else self.noise_rows)[index]
        if self.rows is not None:
            self.rows = self.rows[index]
            return
        self.cache.batch_select_indices(index)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.rope = None if self.rope is None else self.rope[index]

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """The still-sampling rows' logits out of the model's batch's."""
        return last if self.rows is None else last[self.rows]

    def position_ids(self) -> torch.Tensor:
        """The next token's positions: over real tokens, plus each row's M-RoPE offset in all three axes
        for image prompts."""
        if self.rope is None:
            return self.positions
        return (self.positions + self.rope.unsqueeze(1)).unsqueeze(0).expand(3, -1, -1)

    def step_ids(self, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
        """The model's next input: the still-sampling rows' tokens (pad in the unused rows)."""
        if self.rows is None:
            return tokens
        return torch.full_like(self.positions[:, 0], pad_id).index_put((self.rows,), tokens)


def _prefill(
    model: torch.nn.Module,
    prompts: list[list[int]],
    s: SamplingSettings,
    device: torch.device,
    images: list[dict[str, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, _Batch]:
    """The prompts' forward, left-padded, the last position's logits only: where the cache can copy rows,
    each distinct prompt once (a group's G completions share it; an image prompt is the same prompt only with
    the same images) and its KV cache then copied to each of its rows. Returns every row's logits and the
    batch."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=getattr(model, "config", None))  # none: lazy layers, no row picking
    shared = _rows_selectable(cache)
    keys = [(tuple(p), id(images[i]) if images else 0) for i, p in enumerate(prompts)]
    first: dict[Any, int] = {}  # each distinct prompt's first row
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    picked = list(first.values()) if shared else list(range(len(prompts)))
    slot = {key: j for j, key in enumerate(first)}
    ids, prompt_mask = _left_padded([prompts[i] for i in picked], s.pad_id, device)
    inputs = batch_images([images[i] for i in picked], ids.size(1), ids.size(1), device) if images else None
    positions, rope = rope_positions(model, ids, prompt_mask, inputs) if inputs else (None, None)
    last, cache = decode_step(model, ids, prompt_mask, cache, 1, inputs, positions)
    rows = len(prompts)
    if len(picked) < rows:
        of = torch.tensor([slot[k] for k in keys], device=device)
        cache.batch_select_indices(of)
        last, prompt_mask = last[of], prompt_mask[of]
        rope = None if rope is None else rope[of]
    mask = torch.cat([prompt_mask, prompt_mask.new_ones((rows, s.max_new_tokens))], dim=1)
    where = torch.arange(rows, device=device)
    lengths = prompt_mask.sum(dim=1, keepdim=True)
    return last, _Batch(where, cache, mask, lengths, rows=None if shared else where.clone(), rope=rope)


def _sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    s: SamplingSettings,
    device: torch.device,
    shown: Progress | None = None,
    images: list[dict[str, torch.Tensor]] | None = None,
) -> list[Sampled]:
    """The sampling loop of `sample_completions` (model already in eval mode, no grad): one batched forward
    per token over the rows still sampling, one batched draw (argmax(probs / noise)) for all of them."""
    rows, width = len(prompts), max(len(p) for p in prompts)
    gens = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    out = torch.full((rows, s.max_new_tokens), s.pad_id, dtype=torch.long, device=device)
    lengths = torch.full((rows,), s.max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    entropy = torch.zeros(rows, dtype=torch.float64, device=device)
    eos = torch.tensor(s.eos_ids, device=device)
    last, batch = _prefill(model, prompts, s, device, images)
    block = noise_block(s.max_new_tokens, last.size(-1))
    for token in range(s.max_new_tokens):
        if shown is not None:
            shown.update(token)
        if token % block == 0:
            batch.draw(gens, min(block, s.max_new_tokens - token), last.size(-1))
        tokens, step_entropy = _draw(batch.logits(last), batch.step_noise(token % block), s)
        out[batch.where, token] = tokens
        entropy[batch.where] += step_entropy.double()
        ended = torch.isin(tokens, eos)
        if bool(ended.any()):
            lengths[batch.where[ended]] = token + 1
            finished[batch.where[ended]] = True
            if bool(ended.all()):
                break
            batch.keep(~ended)
            tokens = tokens[~ended]
        if token + 1 < s.max_new_tokens:
            last = _decode(model, batch.step_ids(tokens, s.pad_id), batch, width + token + 1)
    return [
        Sampled(ids[:n], not e, h)
        for ids, n, e, h in zip(
            out.tolist(), lengths.tolist(), finished.tolist(), entropy.tolist(), strict=True
        )
    ]


def _draw(last: torch.Tensor, noise: torch.Tensor, s: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's next token, argmax(probs / noise) over the top-k / top-p filtered softmax(logits / T)
    (torch.multinomial's one-sample draw, batched), and its entropy under softmax(logits / T)."""
    logits = last.float() if s.temperature == 1.0 else last.float() / s.temperature  # x / 1 is x
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    probs = torch.softmax(_filtered(logits, s.top_k, s.top_p), dim=-1)
    return (probs / noise).argmax(dim=-1), entropy


def _decode(model: torch.nn.Module, tokens: torch.Tensor, batch: _Batch, seen: int) -> torch.Tensor:
    """One token's forward over the batch's KV cache (`seen` columns of the mask so far, this token's
    included): each row's logits for the next token."""
    result = model(
        input_ids=tokens.unsqueeze(1),
        attention_mask=batch.mask[:, :seen],
        position_ids=batch.position_ids(),
        cache=batch.cache,
        use_cache=True,
    )
    batch.cache = result.cache
    batch.positions = batch.positions + 1
    return result.logits[:, -1]


@contextmanager
def generating(strategy: Strategy) -> Iterator[torch.nn.Module]:
    """The module to sample with: the engine's bare module (a DDP or DeepSpeed wrapper's forward may sync
    buffers or run hooks, and ranks sample different numbers of tokens), and under FSDP2 with every layer's
    parameters gathered once for the whole rollout: resharding after forward is switched off, so the first
    forward all-gathers each layer and the following ones (one per token) gather nothing; on exit every
    layer is resharded and its setting restored (torch's documented pattern for evaluation)."""
    from torch.distributed.fsdp import FSDPModule

    bare = strategy.unwrap()
    sharded = [m for m in bare.modules() if isinstance(m, FSDPModule)]
    saved = [_reshard_setting(m) for m in sharded]
    for m in sharded:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield bare
    finally:
        for m, setting in zip(sharded, saved, strict=True):
            m.reshard()
            _restore_reshard_setting(m, setting)


def _reshard_setting(module: Any) -> tuple[Any, list[Any]]:
    """An FSDP2 module's reshard-after-forward state (torch keeps it per parameter group; no public getter)."""
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def _restore_reshard_setting(module: Any, setting: tuple[Any, list[Any]]) -> None:
    """Put back what `_reshard_setting` read."""
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward = setting[0]
    for group, info in zip(state._fsdp_param_groups, setting[1], strict=True):
        group.post_forward_mesh_info = info


def micro_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    trained: list[bool],
    advantages: torch.Tensor,
    pad_id: int,
    sampled: list[list[bool]] | None = None,
    images: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """One GRPO micro-batch (`zerofit.objectives.grpo.loss`): prompts left-padded, completions right-padded, the
    completion tokens as labels where `trained` (a masked truncated completion has none) and, for a multi-turn
    trajectory, only where `sampled` (per token: the policy's own; template and tool tokens are masked); image
    prompts' `images` under the loss's prefix, and no positions (the model's M-RoPE rule computes them)."""
    p_ids, p_mask = _left_padded(prompts, pad_id, torch.device("cpu"))
    width = max(1, max(len(c) for c in completions))
    c_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    c_mask = torch.zeros_like(c_ids)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        c_mask[i, : len(c)] = 1
    input_ids = torch.cat([p_ids, c_ids], dim=1)
    mask = torch.cat([p_mask, c_mask], dim=1)
    keep = c_mask.bool() & torch.tensor(trained).unsqueeze(1)
    for i, own in enumerate(sampled or []):
        keep[i, : len(own)] &= torch.tensor(own, dtype=torch.bool)
    labels = torch.cat([torch.full_like(p_ids, IGNORE_INDEX), c_ids.where(keep, IGNORE_INDEX)], dim=1)
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "advantages": advantages.float(),
    }
    if images:
        return {
            **batch,
            **prefixed(batch_images(images, p_ids.size(1), input_ids.size(1), torch.device("cpu"))),
        }
    return {**batch, "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0)}


def reward_table(
    flat: list[int],
    total: int,
    weighted: torch.Tensor,
    each: dict[str, torch.Tensor],
    names: Sequence[str],
    sampled: list[Sampled],
) -> torch.Tensor:
    """A rank's share of the [total, each of `names`, length, truncated, entropy sum] x `total` float64
    table: its completions' columns `flat` filled, the others 0 (an all-reduce sum completes it)."""
    local = torch.zeros(4 + len(names), total, dtype=torch.float64)
    if not flat:
        return local
    index = torch.tensor(flat, dtype=torch.long)
    local[0, index] = weighted.double().cpu()
    for k, name in enumerate(names):
        local[1 + k, index] = each[name].double().cpu()
    local[-3, index] = torch.tensor([float(len(s.ids)) for s in sampled], dtype=torch.float64)
    local[-2, index] = torch.tensor([float(s.truncated) for s in sampled], dtype=torch.float64)
    local[-1, index] = torch.tensor([s.entropy_sum for s in sampled], dtype=torch.float64)
    return local


@dataclass
class Rollouts:
    """Everything a GRPO loop step needs besides the train step (built by `zerofit.recipe.assembly`)."""

    prompts: Sequence[PromptRow]
    sampler: GlobalBatchSampler  # counts prompts: rl.prompts_per_step per step
    batch: BatchSplit  # counts completions: micro x accumulation x dp = G x prompts_per_step
    group_size: int
    sampling: SamplingSettings
    score: Scorer
    decode: Callable[[list[int]], str]
    seed: int
    estimator: Callable[[torch.Tensor, int], torch.Tensor] = field(  # the objective's; GRPO's by default
        default_factory=lambda: functools.partial(group_advantages, scale="group")
    )
    # the objective's reward penalty (RLOO's KL with rl.beta > 0): (strategy, model, this rank's micro-batches,
    # their global completion indices, N) -> (the penalty [N] on every rank, its metrics)
    penalty: Callable[..., tuple[torch.Tensor, dict[str, float]]] | None = None
    mask_truncated: bool = False
    old_logps: bool = False  # rl.num_iterations > 1
    temperature: float = 1.0
    cross_entropy: str = "chunked"
    reward_names: tuple[str, ...] = ()
    log_completions_every: int = 0  # rl.log_completions_every (0: never)
    agent: Agent | None = None  # rl.tools / rl.environment: multi-turn trajectories (`zerofit.loop.turns`)
    shown_per_step: int = 4  # completions written to completions.jsonl at such a step
    shown: list[dict[str, Any]] = field(default_factory=list)  # this step's sampled completions (rank 0)

    def step_split(self, strategy: Strategy, step: int) -> tuple[list[int], int, list[list[int]]]:
        """Step `step`'s prompt rows (data indices), its number of completions (G per prompt) and this rank's
        micro-batches of global completion indices: the one split of the global batch, whatever the engine."""
        rows = self.sampler.batch_indices(step)
        total = len(rows) * self.group_size
        b = self.batch
        mine = split_global_batch(
            list(range(total)), b.micro_batch_size, b.grad_accum_steps, b.dp_size, strategy.dp_rank
        )
        return rows, total, mine

    def step_batches(
        self, strategy: Strategy, model: torch.nn.Module, step: int
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """This rank's micro-batches of step `step`'s rollout, and the step's rollout metrics (global)."""
        started = time.perf_counter()
        rows, total, mine = self.step_split(strategy, step)
        flat = [c for micro in mine for c in micro]
        prompt_of = [self.prompts[rows[c // self.group_size]] for c in flat]
        seeds = [completion_seed(self.seed, step, c) for c in flat]
        what, limit = f"step {step + 1}: sampling {len(flat)} completions", self.sampling.max_new_tokens
        with (
            generating(strategy) as policy,
            progress(what, limit, "tokens", enabled=strategy.rank == 0) as shown,
        ):
            if self.agent is None:
                images = [images_of(p) for p in prompt_of]
                sampled = sample_completions(
                    policy,
                    [p.input_ids for p in prompt_of],
                    seeds,
                    self.sampling,
                    strategy.device,
                    shown,
                    images if any(images) else None,  # type: ignore[arg-type]
                )
            else:
                sampled = self._trajectories(policy, strategy.device, prompt_of, flat, step, shown)
        generation_s = time.perf_counter() - started
        table = self._scored(strategy, step, flat, prompt_of, sampled, total)
        by_index = dict(zip(flat, sampled, strict=True))
        batches = [self._micro(strategy, model, micro, rows, by_index) for micro in mine]
        rewards, penalty_metrics = table[0], {}
        if self.penalty is not None:  # RLOO's KL in the reward, by the rollout policy (before any update)
            penalty, penalty_metrics = self.penalty(strategy, model, batches, mine, total)
            rewards = rewards - penalty
        advantages = self.estimator(rewards, self.group_size)
        for micro, batch in zip(mine, batches, strict=True):
            batch["advantages"] = advantages[micro].float()
        metrics = self._metrics(table, generation_s, time.perf_counter() - started - generation_s)
        if self.agent is not None:
            metrics.update(agent_metrics(strategy, flat, sampled, total))
            # per token the policy sampled (a trajectory's length also counts its template and tool tokens)
            metrics["entropy"] = float(table[-1].sum()) / max(metrics["agent/sampled_tokens"], 1.0)
        return batches, {**metrics, **penalty_metrics}

    def _trajectories(
        self,
        policy: torch.nn.Module,
        device: torch.device,
        prompt_of: list[PromptRow],
        flat: list[int],
        step: int,
        shown: Progress | None,
    ) -> list[Sampled]:
        """This rank's multi-turn trajectories (`zerofit.loop.turns`), each turn sampled as a completion is."""
        from zerofit.loop.turns import sample_trajectories

        def sample(
            prompts: list[list[int]], seeds: list[int], s: SamplingSettings, seen: Progress | None
        ) -> list[Sampled]:
            return sample_completions(policy, prompts, seeds, s, device, seen)

        assert self.agent is not None
        fields = sample_trajectories(
            self.agent, sample, prompt_of, flat, self.seed, step, self.sampling, shown
        )
        return [Sampled(**f) for f in fields]

    def _scored(
        self,
        strategy: Strategy,
        step: int,
        flat: list[int],
        prompt_of: list[PromptRow],
        sampled: list[Sampled],
        total: int,
    ) -> torch.Tensor:
        """The global [total, each function's, length, truncated, entropy sum] x N table, every rank's columns
        filled by one all-reduce (float64)."""
        texts = [self.decode(s.ids) if s.text is None else s.text for s in sampled]
        extra = None if self.agent is None else {MESSAGES_COLUMN: [s.messages for s in sampled]}
        failed = next((s.failure for s in sampled if s.failure is not None), None)  # an environment's
        # a RewardError names the data row, and the 1-based step
        weighted, each = self.agreed_score(prompt_of, texts, step + 1, strategy, extra, failed)
        if self.agent is not None and self.agent.environment is not None:
            each[ENVIRONMENT_REWARD] = torch.tensor([s.env_reward for s in sampled], dtype=torch.float64)
            weighted = weighted.double() + each[ENVIRONMENT_REWARD]
        local = reward_table(flat, total, weighted, each, self.reward_names, sampled)
        if strategy.rank == 0:
            self.shown = [
                {
                    "prompt": p.text,
                    "completion": t,
                    REWARD: float(w),
                    **{f"rewards/{n}": float(each[n][i]) for n in self.reward_names},
                    **({} if sampled[i].messages is None else {MESSAGES_COLUMN: sampled[i].messages}),
                }
                for i, (p, t, w) in enumerate(zip(prompt_of, texts, weighted.tolist(), strict=True))
            ]
        return strategy.all_reduce_sum(local.to(strategy.device)).cpu()

    def agreed_score(
        self,
        rows: Sequence[PromptRow],
        texts: list[str],
        step: int,
        strategy: Strategy,
        extra: dict[str, list[Any]] | None = None,
        failed: str | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's rewards of `texts`, the completions of `rows` (their prompt texts, columns and data
        records go to the reward functions; `step` 1-based); a reward that failed on any rank (its one
        paragraph, `RewardError`) stops every rank with that paragraph, said once (rank 0), before the step
        trains or saves anything, so the last checkpoint stays the last good one. A rank with no completions
        (a held-out evaluation's short last share, `zerofit.loop.held_out`) calls no function and only joins
        the agreement; so does a rank whose rollout `failed` already (an environment's paragraph,
        `zerofit.loop.environment`), which the same agreement says instead."""
        columns: dict[str, list[Any]] = {}
        for p in rows:
            for key, value in p.columns.items():
                columns.setdefault(key, []).append(value)
        columns.update(extra or {})  # a multi-turn trajectory's whole conversation (`messages`)
        failure: str | None = failed
        try:
            empty = torch.zeros(0, dtype=torch.float64)
            scored = (
                self.score([p.text for p in rows], texts, columns, step, [p.record for p in rows])
                if texts and failed is None
                else (empty, {name: empty for name in self.reward_names})
            )
        except ZerofitError as exc:
            failure, scored = str(exc), (torch.zeros(0), {})
        agree_on_failure(strategy, failure)
        return scored

    def _micro(
        self,
        strategy: Strategy,
        model: torch.nn.Module,
        micro: list[int],
        rows: list[int],
        by_index: dict[int, Sampled],
    ) -> dict[str, torch.Tensor]:
        """One micro-batch of this rank's completions `micro` (with the old policy's log-probs if kept; its
        advantages are set once the whole batch's are known)."""
        mine = [by_index[c] for c in micro]
        prompts = [self.prompts[rows[c // self.group_size]] for c in micro]
        images = [images_of(p) for p in prompts]
        batch = micro_batch(
            [
                p.input_ids if s.prompt_ids is None else s.prompt_ids
                for p, s in zip(prompts, mine, strict=True)
            ],
            [s.ids for s in mine],
            [not (self.mask_truncated and s.truncated) for s in mine],
            torch.zeros(len(micro)),
            self.sampling.pad_id,
            sampled=None if self.agent is None else [s.trained or [] for s in mine],
            images=images if any(images) else None,  # type: ignore[arg-type]
        )
        if self.old_logps:
            with torch.no_grad():
                inputs = grpo_inputs(batch, strategy.device)
                batch["old_logps"] = policy_logps(
                    model, inputs, batch["labels"], self.cross_entropy, self.temperature
                ).cpu()
        return batch

    def log_completions(self, run_dir: Path, steps_done: int) -> list[dict[str, Any]]:
        """Rank 0: append a few of this step's completions (rank 0's own) to the run's completions.jsonl when
        `rl.log_completions_every` says so: step, prompt, completion, reward and each reward function's
        score, one JSON object a line. Returns the rows written (none at other steps), which the loop also
        sends to the metrics sinks as a table (W&B: a multi-turn conversation as its JSON text, one cell)."""
        every = self.log_completions_every
        if every <= 0 or steps_done % every != 0 or not self.shown:
            return []
        rows = [{"step": steps_done, **row} for row in self.shown[: self.shown_per_step]]
        with (run_dir / COMPLETIONS_FILE).open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return [
            {**row, MESSAGES_COLUMN: json.dumps(row[MESSAGES_COLUMN])} if MESSAGES_COLUMN in row else row
            for row in rows
        ]

    def _metrics(self, table: torch.Tensor, generation_s: float, scoring_s: float) -> dict[str, float]:
        """The step's rollout fields of metrics.jsonl (means over the global batch's completions)."""
        reward, lengths, truncated = table[0], table[-3], table[-2]
        fields = {
            REWARD: float(reward.mean()),
            "reward_std": float(reward.std()) if reward.numel() > 1 else 0.0,
            **{f"rewards/{n}": float(table[1 + k].mean()) for k, n in enumerate(self.reward_names)},
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/truncated_fraction": float(truncated.mean()),
            "entropy": float(table[-1].sum() / lengths.sum().clamp(min=1)),
            "time/generation_s": generation_s,
            "time/scoring_s": scoring_s,
            "generation_tokens_per_s": float(lengths.sum()) / max(generation_s, 1e-9),
        }
        return fields
