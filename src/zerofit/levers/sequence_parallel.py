"""Ulysses sequence parallelism's data side: one rank's shard of a micro-batch its group shares.

With `distributed.sequence_parallel: N`, the N consecutive ranks of a group get the same micro-batch (the
same examples; `Strategy.dp_rank` picks them) and each keeps 1/N of every sequence. DeepSpeed's attention
(`deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`) all-to-alls q/k/v so each rank
attends over the whole sequence for 1/N of the heads, then back. Everything outside attention is per
token, so it runs on the shard alone.

The shard is cut here rather than by DeepSpeed's `UlyssesSPDataLoaderAdapter`, whose iteration hands each
rank a different dataloader sample in turn: zerofit's sampler and token normalizer decide the global batch
(docs/design.md), and the shard only has to keep the token arithmetic exact:

- the labels are shifted BEFORE the cut (`zerofit.token_loss.sums.SHIFTED_LABELS`), so the last token of a shard
  predicts the first of the next one, and every valid label is counted and trained on exactly once in the
  group (the shards partition the shifted targets);
- a micro-batch is padded at the right to a multiple of N positions (padding has IGNORE_INDEX targets and
  comes after every real token, so causal attention, which the all-to-all path always uses, never lets it
  reach a real one), and to `rows` rows (DeepSpeed's attention is built for one micro-batch size);
- position_ids are the global positions, which DeepSpeed all-gathers back before attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside the shard functions: the head-count rule is also checked while a config
# resolves (`config.resolve`), which stays torch-free.

__all__ = ["head_count_problem", "shard_micro_batch"]


def head_count_problem(heads: int, kv_heads: int, sp: int) -> str | None:
    """Why a model with `heads` attention and `kv_heads` key/value heads cannot be split over `sp` ranks,
    or None. Each rank attends with heads / sp query heads; key/value heads divide too, or (DeepSpeed
    replicates them) sp is a multiple of their count."""
    if heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0):
        return None
    valid = [n for n in range(2, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    return (
        f"distributed.sequence_parallel = {sp} splits the attention heads across {sp} ranks, and this model "
        f"has {heads} attention heads and {kv_heads} key/value heads: the attention heads must be divisible "
        f"by it, and the key/value heads divisible by it (or it a multiple of them); set "
        f"distributed.sequence_parallel to one of {valid or 'none (use 1)'}, or 1"
    )


def _pad_to(tensor: torch.Tensor, rows: int, width: int, value: int) -> torch.Tensor:
    """`tensor` [r, w] right-padded with `value` to [rows, width]."""
    import torch.nn.functional as F

    return F.pad(tensor, (0, width - tensor.shape[1], 0, rows - tensor.shape[0]), value=value)


def shard_micro_batch(
    batch: dict[str, torch.Tensor], sp: int, sp_rank: int, rows: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """This rank's shard of a collated (right-padded, `zerofit.data.collate`) micro-batch: input_ids,
    position_ids, attention_mask (only counted, never given to the model) and the shifted labels of
    positions [sp_rank * C, (sp_rank + 1) * C), C = the padded length / sp."""
    import torch

    from zerofit.token_loss.sums import IGNORE_INDEX, SHIFTED_LABELS

    seq = batch["input_ids"].shape[1]
    width = -(-seq // sp) * sp
    rows = max(rows, batch["input_ids"].shape[0])
    labels = batch["labels"]
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]  # position t predicts label t+1, across the cut below
    padded = {
        "input_ids": _pad_to(batch["input_ids"], rows, width, pad_id),
        "attention_mask": _pad_to(batch["attention_mask"], rows, width, 0),
        SHIFTED_LABELS: _pad_to(targets, rows, width, IGNORE_INDEX),
    }
    padded["position_ids"] = torch.arange(width, dtype=torch.long).expand(rows, width).contiguous()
    chunk = width // sp
    cut = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return {key: value[:, cut].contiguous() for key, value in padded.items()}
