"""zerofit's GRPO loss (and its gradient's norm) equals TRL's GRPOTrainer per-step loss at accumulation 1, where
TRL installs.

The same tiny model, prompts, fixed completions and advantages go through `GRPOTrainer._compute_loss` and
through `train_step` with `GRPOObjective`, for each loss type (beta 0, on-policy: TRL's old log-probs are the
detached current ones, as zerofit's). Definitional differences, avoided here: TRL gives the model no
position ids, so a left-padded prompt's positions count its padding (zerofit counts real tokens only): the
prompts here have one length; TRL normalizes grpo / dr_grpo per micro-batch and divides by the accumulation
steps (the same at accumulation 1, and whenever every micro-batch has as many completions).

The losses agree within 1e-6. The gradients: zerofit's norm is within 1e-5 of the definition's by plain
autograd (full fp32 log-softmax); TRL's, computed through its fused lm_head path (`fused_lm_head=True`), is
~3e-4 away from both on this batch, so it is held to 1e-3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.loop.rollout import micro_batch
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.grpo.loss import GRPOObjective, GRPOSettings

pytestmark = pytest.mark.slow

PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52]]
COMPLETIONS = [[60, 61, 2], [62], [63, 64, 65, 66], [67, 2], [70, 71], [72, 73, 74], [75], [76, 77, 78, 2]]
ADVANTAGES = torch.tensor([0.9, -0.3, 1.2, -1.8, 0.4, -0.7, 1.1, -0.5])  # not centred: a non-zero loss
MAX_COMPLETION = 5


def _model() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(), dtype=torch.float32)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One GRPOTrainer on the tiny model (built once: ~15 s); each test sets its loss type."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from zerofit.models.tiny import build_tokenizer

    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        beta=0.0,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
    )
    built = trl.GRPOTrainer(
        model=_model(),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 8),
        processing_class=build_tokenizer(),
    )
    built.current_gradient_accumulation_steps = 1  # what Trainer's loop sets: accumulation 1
    return built


def _trl_loss(trainer: Any, loss_type: str) -> tuple[float, float]:
    """TRL's `_compute_loss` on the fixed completions (its own per-token log-probs, on-policy) and the norm
    of its gradient."""
    trainer.loss_type = loss_type
    width = max(len(c) for c in COMPLETIONS)
    ids = torch.zeros(len(COMPLETIONS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(COMPLETIONS):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    prompt_ids = torch.tensor([PROMPTS[i // 4] for i in range(len(COMPLETIONS))])
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": ADVANTAGES,
        "num_items_in_batch": mask.sum(),
    }
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
    return float(loss.detach()), float(torch.cat(grads).norm())


def _definition_grad_norm(loss_type: str) -> float:
    """The gradient norm of the loss type's definition by plain autograd, one unpadded sequence at a time
    (full fp32 log-softmax)."""
    model = _model().train()
    terms, tokens = [], sum(len(c) for c in COMPLETIONS)
    for i, completion in enumerate(COMPLETIONS):
        ids = torch.tensor([PROMPTS[i // 4] + completion])
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        p = len(PROMPTS[i // 4])
        lp = torch.stack([logp[p + j - 1, t] for j, t in enumerate(completion)])
        per_token = -ADVANTAGES[i] * torch.exp(lp - lp.detach())
        terms.append(per_token.mean() if loss_type == "grpo" else per_token.sum())
    total = torch.stack(terms).sum()
    scale = {"grpo": len(COMPLETIONS), "dapo": tokens, "dr_grpo": len(COMPLETIONS) * MAX_COMPLETION}[
        loss_type
    ]
    (total / scale).backward()
    return float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_loss_is_trls(loss_type: str, trainer: Any) -> None:
    expected, grad_norm = _trl_loss(trainer, loss_type)
    model = _model()
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.0),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    batch = micro_batch(
        [PROMPTS[i // 4] for i in range(len(COMPLETIONS))], COMPLETIONS, [True] * 8, ADVANTAGES, pad_id=0
    )
    objective = GRPOObjective(GRPOSettings(loss_type=loss_type, max_completion_length=MAX_COMPLETION))
    result = train_step(strategy, model, [batch], None, "unchunked", objective)
    assert result.loss == pytest.approx(expected, abs=1e-6)
    assert result.grad_norm == pytest.approx(_definition_grad_norm(loss_type), rel=1e-5)
    assert result.grad_norm == pytest.approx(grad_norm, rel=1e-3)  # TRL's: see the module docstring
    assert abs(expected) > 1e-3  # not a vacuous zero
