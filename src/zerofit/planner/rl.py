"""What an online-RL step (`train.objective: grpo`) adds to the memory plan: its global batch in prompts,
completions and tokens, and the generation phase that runs before training.

A GRPO step first generates: each rank's share of the step's completions (`rl.prompts_per_step` x
`rl.num_generations` / data-parallel ranks) decoded together with transformers' `generate` and its KV cache,
no grad, the adapters on. The generation phase holds, besides the model's resident state:

    KV cache          2 (keys, values) x layers x kv_heads x head_dim x compute bytes per token, for every
                      completion of the rank x (max_prompt_length + max_completion_length) tokens
    sampling logits   the last position's logits per completion (generate keeps only those: the prefill
                      keeps one position), upcast to fp32, softmax'd, sorted with int64 indices for top-k /
                      top-p: (2 + 4 + 4 + 8) bytes per vocabulary entry per completion
    prefill layer     one decoder layer's no-grad working set over the prompts: its input and output, q/k/v
                      and the MLP's gate, up and product, per prompt token of every completion

Then it trains on the completions: micro-batches of `batch.micro_batch_size` completions, each of
max_prompt_length + max_completion_length tokens (the training scenario's `seq_len`), one sequence per
completion. Before each update the reference pass (`rl.beta` > 0: adapters off) and the old-policy pass
(`rl.num_iterations` > 1) run no-grad forwards of the same micro-batches, whose peak is below the training
forward's; what they keep is one fp32 log-prob per completion token, held with the rollout's token ids and
masks through the training phase (`held_lines`).

Assumptions (said in the plan): the rank's completions generate in one `generate` call; the KV cache is
transformers' dynamic cache in the compute dtype, grown to the full length (an upper bound for completions
that stop early).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerofit.core.precision import GIB
from zerofit.objectives.grpo import completions_per_step
from zerofit.planner.shapes import ModelShape

if TYPE_CHECKING:
    from zerofit.objectives.spec import ObjectiveSpec

__all__ = ["RLShape", "generation_lines", "held_lines", "rl_batch", "rl_notes"]

_SAMPLING_BYTES_PER_VOCAB = 2 + 4 + 4 + 8  # half logits, fp32 upcast, probabilities, int64 sort indices
_HELD_BYTES_PER_TOKEN = 8 + 1 + 1  # int64 token id, attention mask, completion mask (bool)
_LOGP_BYTES = 4  # one fp32 log-prob per completion token


@dataclass(frozen=True)
class RLShape:
    """The `rl.*` settings the memory of a GRPO step depends on, for one rank."""

    completions: int  # this rank's completions per step (its prompts x num_generations)
    prompt_len: int  # rl.max_prompt_length
    completion_len: int  # rl.max_completion_length
    reference: bool  # rl.beta > 0: reference log-probs kept
    old_policy: bool  # rl.num_iterations > 1: old-policy log-probs kept
    objective: str  # train.objective, as the notes name it (its spec's name)

    @property
    def seq_len(self) -> int:
        """One completion's training sequence: its prompt and completion."""
        return self.prompt_len + self.completion_len


def rl_shape(cfg: Any, objective: ObjectiveSpec, dp_size: int) -> RLShape | None:
    """The RL shape of a resolved config (None unless its objective generates its sequences)."""
    if not objective.generates:
        return None
    rl = cfg.rl
    per_rank = -(-completions_per_step(cfg) // max(dp_size, 1))
    return RLShape(
        per_rank,
        rl.max_prompt_length,
        rl.max_completion_length,
        rl.beta > 0,
        rl.num_iterations > 1,
        objective.name,
    )


def rl_batch(cfg: Any, dp_size: int) -> dict[str, Any]:
    """The global batch of a GRPO config in prompts, completions and tokens (`zerofit plan`'s `rl` block)."""
    rl = cfg.rl
    completions = completions_per_step(cfg)
    seq = rl.max_prompt_length + rl.max_completion_length
    return {
        "prompts_per_step": rl.prompts_per_step,
        "num_generations": rl.num_generations,
        "completions_per_step": completions,
        "completions_per_rank": -(-completions // max(dp_size, 1)),
        "max_prompt_length": rl.max_prompt_length,
        "max_completion_length": rl.max_completion_length,
        "max_tokens_per_step": completions * seq,
        "max_completion_tokens_per_step": completions * rl.max_completion_length,
        "loss_type": rl.loss_type,
        "beta": rl.beta,
        "num_iterations": rl.num_iterations,
    }


def generation_lines(rl: RLShape, shape: ModelShape, compute_bytes: int) -> dict[str, int]:
    """The generation phase's tensors beyond the resident model state (label -> bytes), one rank."""
    n, length = rl.completions, rl.seq_len
    kv = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * compute_bytes * n * length
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    layer = (2 * shape.hidden_size + qkv + 3 * shape.intermediate_size) * compute_bytes
    return {
        f"generation: KV cache ({n} completions x {length} tokens, {shape.num_layers} layers)": kv,
        f"generation: sampling logits ({n} x {shape.vocab_size:,} vocabulary, fp32, sorted)": n
        * shape.vocab_size
        * _SAMPLING_BYTES_PER_VOCAB,
        f"generation: prefill, one layer's working set ({n} x {rl.prompt_len} prompt tokens)": n
        * rl.prompt_len
        * layer,
    }


def held_lines(rl: RLShape) -> dict[str, int]:
    """What the rollout keeps through the training phase (label -> bytes), one rank."""
    n = rl.completions
    lines = {f"rollout: {n} completions' token ids and masks": n * rl.seq_len * _HELD_BYTES_PER_TOKEN}
    logps = n * rl.completion_len * _LOGP_BYTES
    if rl.reference:
        lines["rollout: reference log-probs (rl.beta > 0)"] = logps
    if rl.old_policy:
        lines["rollout: old-policy log-probs (rl.num_iterations > 1)"] = logps
    return lines


def rl_notes(rl: RLShape, micro: int, generation_bytes: int) -> list[str]:
    """What the estimate counts for a GRPO step, in words."""
    passes = [
        p
        for p, on in (("the reference (adapters off)", rl.reference), ("the old policy", rl.old_policy))
        if on
    ]
    extra = (
        f"; before the update, no-grad forwards of {' and of '.join(passes)} over the same micro-batches (their "
        "peak below the training forward's; their log-probs held)"
        if passes
        else ""
    )
    return [
        f"train.objective {rl.objective}: first the rank's {rl.completions} completions generate together (KV cache, "
        f"sampling logits and the prefill: {generation_bytes / GIB:.2f} GiB beyond the model's resident state; "
        "an upper bound, every completion grown to the full length), then training on micro-batches of "
        f"{micro} completions of {rl.seq_len} tokens (prompt + completion){extra}"
    ]
