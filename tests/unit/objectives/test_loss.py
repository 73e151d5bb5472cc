"""The chunked cross-entropy against the unchunked one: the same token sums and gradients (fp32, 1e-5),
without ever holding fp32 (tokens x vocab) tensors; Liger where it can run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerofit.models.tiny import ensure_tiny_llama
from zerofit.token_loss.sums import (
    IGNORE_INDEX,
    chunk_tokens,
    chunked_token_sum_loss,
    liger_available,
    token_sum_loss,
)

VOCAB = 300


def _batch(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of 3 rows x 41 positions and labels with masked prompts, padding and an all-masked row."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 41, VOCAB, generator=g)).to(dtype).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (3, 41), generator=g)
    labels[:, :4] = IGNORE_INDEX  # prompt
    labels[1, 25:] = IGNORE_INDEX  # padding
    labels[2] = IGNORE_INDEX  # nothing to learn: contributes zero
    return logits, labels


def _loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, loss_fn: Any) -> tuple[float, torch.Tensor]:
    logits.grad = None
    loss = loss_fn(logits, labels)
    (loss * 0.37).backward()  # a scale, as the loop's 1 / global tokens
    return float(loss.detach()), logits.grad.detach().float().clone()


@pytest.mark.parametrize("chunk", [1, 7, 41, 123, 10_000], ids=lambda c: f"chunk{c}")
def test_chunked_sum_and_gradient_equal_the_unchunked_ones_in_fp32(chunk: int) -> None:
    logits, labels = _batch(torch.float32)
    ref_loss, ref_grad = _loss_and_grad(logits, labels, lambda x, y: token_sum_loss(x, y, "unchunked"))
    loss, grad = _loss_and_grad(logits, labels, lambda x, y: chunked_token_sum_loss(x, y, chunk))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert float((grad - ref_grad).abs().max()) < 1e-5
    assert float(grad[2].abs().max()) == 0.0 and float(grad[:, -1].abs().max()) == 0.0  # masked rows/ends


def test_bf16_logits_give_the_same_fp32_sum_and_a_bf16_gradient() -> None:
    logits, labels = _batch(torch.bfloat16)
    ref_loss, ref_grad = _loss_and_grad(logits, labels, lambda x, y: token_sum_loss(x, y, "unchunked"))
    loss, grad = _loss_and_grad(logits, labels, lambda x, y: chunked_token_sum_loss(x, y, 16))
    # Both sums are fp32 over the same fp32 upcast of the same bf16 logits.
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    assert float((grad - ref_grad).abs().max()) <= 2**-8 * float(ref_grad.abs().max())  # bf16 rounding


def test_an_all_masked_batch_gives_zero_with_a_graph() -> None:
    logits = torch.randn(1, 3, VOCAB, requires_grad=True)
    labels = torch.full((1, 3), IGNORE_INDEX)
    loss = token_sum_loss(logits, labels)
    assert float(loss.detach()) == 0.0
    loss.backward()  # the dummy row of an empty micro-batch still runs backward
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0


class _LargestFloat(TorchDispatchMode):
    """Records the largest fp32 tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_loss_never_holds_fp32_tokens_x_vocab() -> None:
    """bf16 logits of 3 x 41 tokens: the unchunked loss makes fp32 tensors of every token x vocab, the
    chunked one never more than one chunk (forward and backward)."""
    logits, labels = _batch(torch.bfloat16)
    seen = {}
    for name, fn in (
        ("unchunked", lambda x, y: token_sum_loss(x, y, "unchunked")),
        ("chunked", lambda x, y: chunked_token_sum_loss(x, y, 16)),
    ):
        logits.grad = None
        with _LargestFloat() as mode:
            fn(logits, labels).backward()
        seen[name] = mode.largest
    assert seen["unchunked"] >= 3 * 40 * VOCAB
    assert seen["chunked"] == 16 * VOCAB
    assert chunk_tokens(32_000) == 1048 and chunk_tokens(128_256) == 261  # 128 MiB of fp32 per chunk


class _OpNames(TorchDispatchMode):
    """Records the name of every op dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns (so -0.0 and 0.0 differ, as `torch.equal` would not tell)."""
    return t.float().view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_chunk_backward_keeps_the_loops_bits_without_rebuilding_the_targets(dtype: torch.dtype) -> None:
    """A micro-batch within one chunk: backward builds the gradient from the index and mask its forward
    kept (no clamp or comparison of the targets again, no cast of the mask: 9 ops of its own, 13 before),
    and the gradient has the
    chunk loop's bits, for the sum and for per-token losses with gradients of both signs (a negative one
    makes the masked rows -0.0: the same zero, to the bit)."""
    from zerofit.token_loss.sums import _ChunkedCrossEntropySum, shifted_targets

    logits, labels = _batch(dtype)
    flat, targets = logits.reshape(-1, VOCAB), shifted_targets(labels)
    upstream = torch.linspace(-1.5, 1.0, flat.shape[0])
    grads = {}
    for chunk in (flat.shape[0], 7):  # one chunk, then the loop
        for per_token in (False, True):
            logits.grad = None
            out = _ChunkedCrossEntropySum.apply(flat, targets, chunk, per_token)
            with _OpNames() as mode:
                (out * upstream).sum().backward() if per_token else (out * 0.37).backward()
            grads[chunk, per_token] = _bits(logits.grad)
            if chunk > 7:  # its own 9 (+ bf16's cast), the upstream's 3 to 4, the engine's 2
                assert not {"clamp", "ne"} & set(mode.names)
                assert len(mode.names) <= (16 if per_token else 14) + (dtype != torch.float32)
    for per_token in (False, True):
        assert torch.equal(grads[flat.shape[0], per_token], grads[7, per_token])
    assert bool((grads[flat.shape[0], True] == _bits(torch.tensor(-0.0))).any())  # the signed zeros


def test_tiny_llama_loss_and_gradients_agree_with_the_unchunked_loss() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(0), dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX
    results = []
    for impl in ("unchunked", "chunked"):
        model.zero_grad(set_to_none=True)
        loss = token_sum_loss(model(input_ids=ids).logits, labels, impl)
        loss.backward()
        results.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()]))
    (ref_loss, ref_grads), (loss, grads) = results
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(ref_grads, grads, strict=True)) < 1e-5


@pytest.mark.skipif(not (liger_available() and torch.cuda.is_available()), reason="Liger-Kernel runs on CUDA")
def test_liger_gives_the_same_sum_on_cuda() -> None:  # pragma: no cover - needs a GPU and liger-kernel
    logits, labels = _batch(torch.float32)
    ref = float(token_sum_loss(logits, labels, "unchunked").detach())
    liger = float(token_sum_loss(logits.detach().cuda().requires_grad_(), labels.cuda(), "liger").detach())
    assert liger == pytest.approx(ref, rel=1e-5)
