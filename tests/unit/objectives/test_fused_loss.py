"""The fused linear cross-entropy (`train.cross_entropy=fused_linear`): the unchunked loss's token sums and
gradients from the hidden states and the lm_head weight, without the logits ever existing; inside tiny-llama's
lm_head, the same training curve and evaluation loss as the unchunked loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from config_helpers import one_process_strategy
from zerofit.core.errors import ConfigError, DataError
from zerofit.data import Example, collate
from zerofit.loop.evaluate import Evaluator, check_eval_data, evaluation_loss
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.token_loss.fused import (
    FUSED_LINEAR,
    forward_token_sum,
    fused_linear_token_sum,
    install_fused_head,
)
from zerofit.token_loss.sums import IGNORE_INDEX, shifted_targets, token_sum_loss

ROWS, SEQ, HIDDEN, VOCAB, CHUNK = 3, 67, 16, 300, 37  # 201 tokens: 37 does not divide them
TOKENS = ROWS * SEQ


def _operands(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Hidden states, weight, bias and labels with masked prompts, padding and an all-masked row."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, SEQ, HIDDEN, generator=g, dtype=dtype).requires_grad_(True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype).requires_grad_(True)
    bias = torch.randn(VOCAB, generator=g, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels[:, :5] = IGNORE_INDEX  # prompt
    labels[1, 40:] = IGNORE_INDEX  # padding
    labels[2] = IGNORE_INDEX  # nothing to learn
    return hidden, weight, bias, labels


def _sum_and_grads(fn: Any, operands: tuple[torch.Tensor, ...]) -> tuple[float, list[torch.Tensor]]:
    *params, labels = operands
    for p in params:
        p.grad = None
    loss = fn(*params, labels)
    (loss * 0.37).backward()  # a scale, as the loop's 1 / global tokens
    return float(loss.detach()), [p.grad.clone() for p in params]


def _unchunked(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, labels: torch.Tensor) -> Any:
    return token_sum_loss(F.linear(hidden, weight, bias), labels, "unchunked")


def _fused(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, labels: torch.Tensor) -> Any:
    return fused_linear_token_sum(hidden, weight, bias, shifted_targets(labels), CHUNK)


def test_fused_sum_and_gradients_equal_the_unchunked_ones_in_fp32() -> None:
    """Within 1e-6 relative on the sum and 1e-6 on every gradient (hidden, weight, bias), fp32."""
    operands = _operands()
    ref_loss, ref_grads = _sum_and_grads(_unchunked, operands)
    loss, grads = _sum_and_grads(_fused, operands)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for ref, got in zip(ref_grads, grads, strict=True):
        assert float((got - ref).abs().max()) <= 1e-6 * max(1.0, float(ref.abs().max()))
    hidden_grad = grads[0]
    assert float(hidden_grad[2].abs().max()) == 0.0 and float(hidden_grad[:, -1].abs().max()) == 0.0


def test_bf16_autocast_gives_the_reference_sum_and_gradients_within_bf16_rounding() -> None:
    """Under autocast the chunk matmuls run in bf16 as lm_head's would; the weight gradient is summed over
    chunks in fp32 (the reference rounds it once, in bf16)."""
    operands = _operands()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _sum_and_grads(_unchunked, operands)
        loss, grads = _sum_and_grads(_fused, operands)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for ref, got in zip(ref_grads, grads, strict=True):
        assert got.dtype == torch.float32
        assert float((got - ref).abs().max()) <= 2**-7 * float(ref.abs().max())


def test_gradcheck_in_float64() -> None:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.tensor([1, 2, IGNORE_INDEX, 5, 0, IGNORE_INDEX, 3])
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_linear_token_sum(h, w, b, targets, chunk=3), (hidden, weight, bias)
    )


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_logits_and_their_gradient_never_exist() -> None:
    """What autograd saves is the hidden states, the weight, the targets and one log-sum-exp per token; no
    op, forward or backward, makes a tensor larger than one chunk of logits (the unchunked loss makes many
    of tokens x vocab)."""
    hidden, weight, bias, labels = _operands()
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss = _fused(hidden, weight, bias, labels)
    assert sorted(saved) == sorted(
        [
            hidden.reshape(-1, HIDDEN).shape,
            weight.shape,
            bias.shape,
            torch.Size([TOKENS]),
            torch.Size([TOKENS]),
        ]
    )
    with _LargestTensor() as fused_mode:
        _fused(hidden, weight, bias, labels).backward()
    with _LargestTensor() as reference_mode:
        _unchunked(hidden, weight, bias, labels).backward()
    assert fused_mode.largest == CHUNK * VOCAB < TOKENS * VOCAB <= reference_mode.largest
    del loss


def _tiny_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(0), dtype=torch.float32)


def _ragged_examples(n: int = 16) -> list[Example]:
    """Lengths 3..60 with prompts of different sizes (one fully masked): ragged micro-batches."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        length = 3 + (i * 13) % 58
        ids = torch.randint(3, 128, (length,), generator=g).tolist()
        prompt = length if i == 5 else 1 + i % 7
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def _head_output_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shape of every output lm_head gives from now on (a 0-dim loss sum in the fused path)."""
    shapes: list[tuple[int, ...]] = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    return shapes


def _train(cross_entropy: str, steps: int = 4) -> tuple[list[float], torch.Tensor]:
    """`train_step` on tiny-llama (fp32, one process, global batch 8 as 4 micro-batches of 2)."""
    from zerofit.loop.train import train_step

    model = _tiny_llama()
    if cross_entropy == FUSED_LINEAR:
        install_fused_head(model)
    shapes = _head_output_shapes(model)
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    examples = _ragged_examples()
    losses = []
    for step in range(steps):
        window = [examples[(8 * step + k) % len(examples)] for k in range(8)]
        micro = [collate(window[k : k + 2], pad_id=0) for k in range(0, 8, 2)]
        losses.append(train_step(strategy, model, micro, max_grad_norm=1.0, cross_entropy=cross_entropy).loss)
    assert (set(shapes) == {()}) == (cross_entropy == FUSED_LINEAR)  # loss sums from lm_head, never logits
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
def test_tiny_llama_trains_the_same_curve_as_the_unchunked_loss() -> None:
    ref_losses, ref_params = _train("unchunked")
    losses, params = _train(FUSED_LINEAR)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 2e-5, (losses, ref_losses)
    assert float((params - ref_params).abs().max()) < 2e-5
    assert ref_losses[-1] < ref_losses[0]  # it trained: the agreement is not two idle models


def test_tiny_llama_evaluates_the_same_loss_inside_lm_head() -> None:
    examples = _ragged_examples(11)
    model = _tiny_llama()
    strategy = one_process_strategy()
    reference = evaluation_loss(strategy, model, examples, 3, 0, "unchunked")
    install_fused_head(model)
    shapes = _head_output_shapes(model)
    fused = evaluation_loss(strategy, model, examples, 3, 0, FUSED_LINEAR)
    assert shapes and set(shapes) == {()}  # lm_head gave loss sums, never logits
    assert fused.tokens == reference.tokens
    assert fused.loss == pytest.approx(reference.loss, rel=1e-6)


def test_an_evaluation_over_0_tokens_is_an_error_never_a_best_loss() -> None:
    """Eval examples whose labels are all masked (a tampered cache once logged eval/loss 0.0 as the new
    best, and pruning deleted the real best checkpoint): refused when the data is loaded, and should they
    reach an evaluation, it raises the same paragraph instead of returning 0.0 over 0 tokens."""
    masked = [Example(e.input_ids, [IGNORE_INDEX] * len(e.labels)) for e in _ragged_examples(5)]
    for units, what in ((masked, "holds 5 examples whose labels are all masked"), ([], "holds no examples")):
        with pytest.raises(DataError, match="the evaluation data") as refused:
            check_eval_data(units)
        assert what in str(refused.value) and "data.max_seq_len" in str(refused.value)
        assert "\n" not in str(refused.value)
    check_eval_data([*masked, _ragged_examples(2)[1]])  # one example with a response: there is a loss
    evaluator = Evaluator(one_process_strategy(), _tiny_llama(), masked, 2, 0, every_steps=1, max_steps=3)
    with pytest.raises(
        DataError, match=r"holds 5 examples whose labels are all masked.*eval/loss would be 0\.0"
    ):
        evaluator.after_step(1)


def test_outside_the_context_lm_head_gives_the_same_logits_and_names() -> None:
    """Generation, export and any plain forward see the model as it was; checkpoints the same keys."""
    plain, fused = _tiny_llama(), _tiny_llama()
    install_fused_head(fused)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(plain(input_ids=ids).logits, fused(input_ids=ids).logits)
    assert list(fused.state_dict()) == list(plain.state_dict())
    labels = ids.clone()
    inside = forward_token_sum(fused, {"input_ids": ids}, labels, FUSED_LINEAR)
    outside = forward_token_sum(plain, {"input_ids": ids}, labels, "unchunked")
    assert float(inside.detach()) == pytest.approx(float(outside.detach()), rel=1e-6)
    assert fused(input_ids=ids).logits.shape == (2, 9, 128)  # the context is over: logits again


def _tiny_gemma2(**config: Any) -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    shape = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    return Gemma2ForCausalLM(
        Gemma2Config(vocab_size=32, hidden_size=16, intermediate_size=32, **shape, **config)
    )


def test_a_model_that_softcaps_the_logits_after_lm_head_is_refused() -> None:
    """Gemma 2 softcaps after lm_head: refused from its config, and caught at the first forward when the
    config does not say it (the loss must not come back changed)."""
    with pytest.raises(ConfigError, match=r"final_logit_softcapping = 30\.0.*train\.cross_entropy=chunked"):
        install_fused_head(_tiny_gemma2(final_logit_softcapping=30.0))
    model = _tiny_gemma2(final_logit_softcapping=None)
    install_fused_head(model)
    model.config.final_logit_softcapping = 30.0  # the forward applies it; the install never saw it
    ids = torch.randint(0, 32, (1, 6))
    with pytest.raises(ConfigError, match="changes lm_head's output"):
        forward_token_sum(model, {"input_ids": ids}, ids, FUSED_LINEAR)


def test_a_lora_adapted_lm_head_is_refused() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama(), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ConfigError, match=r"plain Linear.*lora\.target_modules"):
        install_fused_head(model.get_base_model())


def test_lora_on_lm_head_is_refused_before_the_load() -> None:
    from zerofit.models.build import check_fused_head_targets

    with pytest.raises(ConfigError, match=r"lora\.target_modules = \['q_proj', 'lm_head'\]"):
        check_fused_head_targets(FUSED_LINEAR, ["q_proj", "lm_head"])
    check_fused_head_targets(FUSED_LINEAR, "all-linear")  # peft's rule leaves the output layer out
    check_fused_head_targets("chunked", ["q_proj", "lm_head"])
