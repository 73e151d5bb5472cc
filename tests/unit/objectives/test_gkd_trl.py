"""zerofit's on-policy distillation loss (`train.objective: gkd`) equals TRL 1.16's GKDTrainer's, where TRL
installs: on fixed logits (`generalized_jsd_loss`, every beta: forward KL, generalized JSD, reverse KL) and on
the same student, teacher and completions (`GKDTrainer.compute_loss` on a real trainer, fp32 on the CPU,
`bf16=False`: TRL's default would autocast its forward), against `train_step` with `GKDObjective`.

TRL gives the models no position ids (positions count padding), so the prompts here have one length and the
completions are right-padded: the positions are then zerofit's. Tolerances: the loss within 1e-6 (the same
fp32 operations), the gradient's norm within 1e-5 relative (the same autograd graph up to the masking's
order: TRL masks after the divergence, zerofit selects the completion positions before it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.loop.rollout import micro_batch
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.gkd.loss import GKDObjective, GKDSettings, generalized_jsd

pytestmark = pytest.mark.slow

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52]]
COMPLETIONS = [[60, 61, 2], [62], [63, 64, 65, 66], [67, 2]]


def _trl() -> Any:
    return pytest.importorskip("trl.experimental.gkd")


@pytest.mark.parametrize("beta", BETAS)
def test_the_divergence_on_fixed_logits_is_trls(beta: float) -> None:
    """Random logits, a label mask with holes, TRL's global-token normalization (`num_items_in_batch`):
    the same loss and the same gradient with respect to the student's logits."""
    gen = torch.Generator().manual_seed(7)
    student = (torch.randn(3, 5, 11, generator=gen) * 2).requires_grad_(True)
    teacher = torch.randn(3, 5, 11, generator=gen) * 2
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    labels[0, :2], labels[2, 3:] = -100, -100
    mask = labels != -100
    trl = _trl().GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=beta, num_items_in_batch=mask.sum()
    )
    (trl_grad,) = torch.autograd.grad(trl, student)
    ours = generalized_jsd(student[mask], teacher[mask], beta).sum() / mask.sum()
    (our_grad,) = torch.autograd.grad(ours, student)
    assert float(ours.detach()) == pytest.approx(float(trl.detach()), abs=1e-6) and float(trl.detach()) > 1e-3
    assert torch.allclose(our_grad, trl_grad, atol=1e-7)


def test_beta_0_is_the_forward_kl_and_1_the_reverse() -> None:
    """The endpoints are the named divergences: KL(teacher || student) at 0, KL(student || teacher) at 1."""
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    forward, reverse = (lt.exp() * (lt - ls)).sum(-1), (ls.exp() * (ls - lt)).sum(-1)
    assert torch.allclose(generalized_jsd(s, t, 0.0), forward, atol=1e-6)
    assert torch.allclose(generalized_jsd(s, t, 1.0), reverse, atol=1e-6)


def _model(seed: int | None = None) -> Any:
    """The tiny Llama in fp32; with `seed`, its weights moved by seeded noise (a teacher that differs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(), dtype=torch.float32)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * p.std().clamp(min=1e-3))
    return model


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One real GKDTrainer (student, teacher) in fp32 on the CPU; each test sets its beta."""
    gkd = _trl()
    from datasets import Dataset

    from zerofit.models.tiny import build_tokenizer

    args = gkd.GKDConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=32,
    )
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    return gkd.GKDTrainer(
        model=_model(),
        teacher_model=_model(seed=5),
        args=args,
        train_dataset=Dataset.from_list([{"messages": messages}] * 4),
        processing_class=build_tokenizer(),
    )


def _trl_step(trainer: Any, beta: float) -> tuple[float, float]:
    """TRL's `compute_loss` on the fixed completions (global token normalization) and its gradient's norm."""
    trainer.beta = beta
    batch = micro_batch([PROMPTS[i // 2] for i in range(4)], COMPLETIONS, [True] * 4, torch.zeros(4), 0)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=(batch["labels"] != -100).sum())
    loss.backward()
    grads = [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
    return float(loss.detach()), float(torch.cat(grads).norm())


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_the_loss_on_a_model_is_trls(beta: float, trainer: Any) -> None:
    expected, grad_norm = _trl_step(trainer, beta)
    model, teacher = _model(), _model(seed=5).eval()
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.0),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    batch = micro_batch([PROMPTS[i // 2] for i in range(4)], COMPLETIONS, [True] * 4, torch.zeros(4), 0)
    result = train_step(strategy, model, [batch], None, "chunked", GKDObjective(GKDSettings(beta), teacher))
    assert result.loss == pytest.approx(expected, abs=1e-6) and expected > 1e-3
    assert result.grad_norm == pytest.approx(grad_norm, rel=1e-5)
