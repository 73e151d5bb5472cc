"""The training loss as token sums: what every micro-batch contributes before the one normalization.

The loop (`zerofit.train`) divides these sums by the valid label tokens of the whole global batch; the
planner's trace (`zerofit.planner.trace`) runs the same ops to measure their memory. Labels are unshifted
(HF-style): token t's logits predict label t+1, and `IGNORE_INDEX` marks positions the loss skips
(bos, prompt tokens, padding, the first token of every packed document).

Three implementations of the same sum (`train.cross_entropy`):

- `chunked` (default): a custom autograd function that walks the tokens in chunks, so the fp32 upcast of
  the logits, the log-probabilities and their fp32 gradient only ever exist for one chunk
  (`chunk_tokens(vocab)` rows, ~128 MiB of fp32); the gradient it hands back is in the logits' dtype.
  Unchunked, a micro-batch of 4 x 1024 tokens with a 32k vocabulary holds 0.49 GiB of fp32
  log-probabilities and 0.98 GiB of fp32 gradients at once (13.7 of 31.4 GiB of tensors for Llama-3-8B's
  128k vocabulary at 4 x 2048).
- `unchunked`: `F.cross_entropy` on the fp32 upcast of every logit (the reference the tests compare with).
- `liger`: Liger-Kernel's Triton cross-entropy (CUDA only, `pip install liger-kernel`), which writes the
  gradient into the logits' own storage in forward.

A fourth, `fused_linear` (`zerofit.token_loss.fused`), gives the same sum from the hidden states and the lm_head
weight, so the logits never exist; it runs inside lm_head and so takes the model, not logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CROSS_ENTROPY_IMPLS",
    "IGNORE_INDEX",
    "SHIFTED_LABELS",
    "batch_labels",
    "chunk_tokens",
    "chunked_token_sum_loss",
    "count_label_tokens",
    "liger_available",
    "shifted_targets",
    "token_losses",
    "token_sum_loss",
]

IGNORE_INDEX = -100  # label value the loss skips (bos, prompt tokens, padding)
CROSS_ENTROPY_IMPLS = ("chunked", "unchunked", "liger")
# fp32 bytes of one chunk of logits: small next to a 7B step, large enough that a handful of chunks cover
# a micro-batch (32k vocabulary: 1,048 tokens per chunk; 128k: 261).
CHUNK_FP32_BYTES = 2**27


# A sequence-parallel shard's key (`zerofit.levers.sequence_parallel`): its targets, shifted before the sequence
# was cut, so the last position of a shard predicts the first token of the next one.
SHIFTED_LABELS = "shift_labels"


def batch_labels(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """A micro-batch's labels and whether they are already shifted (a sequence-parallel shard's targets)."""
    if SHIFTED_LABELS in batch:
        return batch[SHIFTED_LABELS], True
    return batch["labels"], False


def count_label_tokens(labels: torch.Tensor, shifted: bool = False) -> int:
    """Valid label tokens of a batch: positions 1.. whose label is not IGNORE_INDEX (position 0 predicts
    nothing); every position of already `shifted` targets."""
    return int(((labels if shifted else labels[:, 1:]) != IGNORE_INDEX).sum())


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the chunked loss: `CHUNK_FP32_BYTES` of fp32 logits."""
    return max(1, CHUNK_FP32_BYTES // (4 * vocab_size))


def shifted_targets(labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """The target of every position, flattened: label t+1 at position t, IGNORE_INDEX at each row's end
    (`shifted`: the labels already are those targets, a sequence-parallel shard's).

    Shifting the labels instead of the logits keeps the logits a free `view(-1, vocab)` (slicing off the
    last position would copy all of them); the last position's gradient is simply zero.
    """
    if shifted:
        return labels.reshape(-1)
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets.reshape(-1)


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of cross-entropy over valid targets, computed chunk by chunk in fp32 (or, `per_token`, the
    per-token cross-entropy itself: fp32, 0 at invalid targets, what a preference objective sums per row).

    Forward keeps only each row's log-sum-exp (fp32, one number per token) besides the logits themselves;
    backward recomputes softmax one chunk at a time and writes the gradient in the logits' dtype. The
    per-token form differs only in the incoming gradient: one number per token instead of one scalar.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int, per_token: bool = False
    ) -> torch.Tensor:
        n = logits.shape[0]
        ctx.chunk, ctx.one_chunk = chunk, n <= chunk
        if ctx.one_chunk:  # one chunk: the same ops without the loop's buffers (the bits are the loop's)
            x = logits.float()
            valid = targets != IGNORE_INDEX
            lse = torch.logsumexp(x, dim=-1)
            index = targets.clamp(min=0).unsqueeze(1)
            per = torch.where(valid, lse - x.gather(1, index).squeeze(1), 0.0)
            # The index (targets' bytes) and the mask (one byte a token) for backward, not rebuilt there.
            ctx.save_for_backward(logits, index, valid, lse)
            return per if per_token else per.sum()
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        tokens = torch.empty(n if per_token else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            x = logits[start : start + chunk].float()
            t = targets[start : start + chunk]
            valid = t != IGNORE_INDEX
            lse_c = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            if per_token:
                tokens[start : start + chunk] = torch.where(valid, lse_c - picked, 0.0)
            else:
                total += torch.where(valid, lse_c - picked, 0.0).sum()
            lse[start : start + chunk] = lse_c
            del x  # before the next chunk's upcast: one fp32 chunk alive at a time
        ctx.save_for_backward(logits, targets, lse)
        return tokens if per_token else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scale = grad_out.float()
        if ctx.one_chunk:  # one chunk: its gradient is the whole one (no copy into a buffer)
            logits, index, valid, lse = ctx.saved_tensors
            return _chunk_grad(logits, index, valid, lse, scale).to(logits.dtype), None, None, None
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            per_token = scale if scale.dim() == 0 else scale[start:stop]
            t = targets[start:stop]
            index, valid = t.clamp(min=0).unsqueeze(1), t != IGNORE_INDEX
            grad[start:stop] = _chunk_grad(logits[start:stop], index, valid, lse[start:stop], per_token)
            # (the chunk's fp32 gradient is freed here, before the next one's: one alive at a time, as the
            # planner counts)
        return grad, None, None, None


def _chunk_grad(
    logits: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """One chunk's fp32 gradient: softmax - one_hot(target), for valid rows only, times the incoming gradient
    (a scalar for the sum, the chunk's per-token gradients for the per-token form). `index`: the targets
    clamped to >= 0, [tokens, 1]; `valid`: the targets that count. bf16/fp16 minus fp32 promotes to one new
    fp32 tensor (no separate upcast copy); the mask times the fp32 scale is the fp32 weight, 1 * scale or
    0 * scale exactly, without a separate cast of the mask."""
    g = torch.sub(logits, lse[:, None]).exp_()
    g.scatter_add_(1, index, torch.full_like(lse[:, None], -1.0))
    return g.mul_((valid * scale)[:, None])


def chunked_token_sum_loss(
    logits: torch.Tensor, labels: torch.Tensor, chunk: int | None = None, shifted: bool = False
) -> torch.Tensor:
    """`token_sum_loss` with the chunked custom autograd function (see the module docstring)."""
    vocab = logits.size(-1)
    flat = logits.reshape(-1, vocab)  # a view: the model's logits are contiguous
    targets = shifted_targets(labels.to(logits.device), shifted)
    return _ChunkedCrossEntropySum.apply(flat, targets, chunk or chunk_tokens(vocab))


def token_losses(logits: torch.Tensor, labels: torch.Tensor, impl: str = "chunked") -> torch.Tensor:
    """Per-token next-token cross-entropy, fp32, shaped like `labels` ([rows, seq]): position t holds the
    loss of label t+1, 0 where that label is IGNORE_INDEX and at each row's last position.

    What preference objectives sum per row (`zerofit.objectives.pairwise.loss`): one fp32 number per token, so a row's
    log-probability is a cheap `-sum(dim=1)`, never full fp32 logits. `chunked` (and `liger`, whose kernel
    only sums: the same values) walks the tokens in chunks exactly as `token_sum_loss` does; `unchunked`
    is `F.cross_entropy(reduction="none")` on the fp32 upcast (the reference the tests compare with).
    """
    rows, seq = labels.shape
    targets = shifted_targets(labels.to(logits.device))
    if impl == "unchunked":
        flat = logits.float().reshape(-1, logits.size(-1))
        per = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="none")
        return per.reshape(rows, seq)
    if impl not in ("chunked", "liger"):
        raise ValueError(f"per-token losses from logits: chunked or unchunked, not {impl!r}")
    vocab = logits.size(-1)
    per = _ChunkedCrossEntropySum.apply(logits.reshape(-1, vocab), targets, chunk_tokens(vocab), True)
    return per.reshape(rows, seq)


def liger_available() -> bool:
    """True when Liger-Kernel can be imported (it needs Triton and a CUDA device to run)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _liger_token_sum_loss(logits: torch.Tensor, labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    from liger_kernel.transformers import LigerCrossEntropyLoss

    vocab = logits.size(-1)
    targets = shifted_targets(labels.to(logits.device), shifted)
    loss = LigerCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    return loss(logits.reshape(-1, vocab), targets).float()


def token_sum_loss(
    logits: torch.Tensor, labels: torch.Tensor, impl: str = "chunked", shifted: bool = False
) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over valid labels, in fp32 (`shifted`: `labels` are
    already the targets of every position, a sequence-parallel shard's).

    `impl` is `train.cross_entropy` (chunked, unchunked or liger: the same sum). A batch with no valid
    label gives a zero sum that still carries a graph, so every rank runs the same backward. The count that
    normalizes it is `count_label_tokens`, taken once per window on the host (no device sync per
    micro-step).
    """
    if impl == "chunked":
        return chunked_token_sum_loss(logits, labels, shifted=shifted)
    if impl == "liger":
        return _liger_token_sum_loss(logits, labels, shifted)
    if impl == "fused_linear":
        raise ValueError(
            "train.cross_entropy=fused_linear computes the loss inside lm_head, from the hidden states, not "
            "from logits: call zerofit.token_loss.fused.forward_token_sum with the model"
        )
    if impl != "unchunked":
        raise ValueError(
            f"unknown cross-entropy implementation {impl!r}; expected one of {CROSS_ENTROPY_IMPLS}"
        )
    flat = logits.float().reshape(-1, logits.size(-1))
    targets = shifted_targets(labels.to(flat.device), shifted)
    return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
