"""zerofit's RLOO equals TRL 1.16's RLOOTrainer (`_compute_loss`, its advantages), TRL in fp32 (`bf16=False`).

- the leave-one-out advantages, plain and `rl.normalize_advantages`, equal TRL's formula (rloo_trainer.py:
  `(sum - r) / (G - 1)` baseline, then `(A - mean) / (nanstd + 1e-4)`) within 1e-6;
- on fixed tensors (log-probs, old log-probs, a mask and advantages; TRL's forward replaced by them): the
  loss within 1e-6 and its gradient with respect to the log-probs within 1e-6, on-policy and off-policy
  (old log-probs up to 0.6 a token apart: summed ratios from 0.64 to 1.67, some clipped);
- rl.beta's reward penalty, beta x sum_t (pi_old - pi_ref), and its `kl` metric by TRL's formula on a LoRA
  model (TRL computes it inside its generation step), within 1e-6;
- on the tiny model and fixed completions, the same two ways: the losses within 1e-6, every gradient element
  within 1e-6 + rel 1e-5.

The loss at beta 0 (beta only moves the rewards: the last test) and accumulation 1: TRL's RLOO returns each
micro-batch's mean over completions and the HF Trainer divides it by the accumulation steps; zerofit's is the
global batch's sum over its completions, the same whenever every micro-batch holds as many completions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from trl_reference import (
    ADVANTAGES,
    COMPLETIONS,
    PROMPTS,
    completion_logps,
    completion_tensors,
    fixed_forward,
    fixed_tensors,
    lora_model,
    offsets,
    shifted_frame,
    tiny_model,
    trl_inputs,
    trl_step,
    trl_trainer,
    zerofit_step,
)
from zerofit.loop.rollout import micro_batch
from zerofit.objectives.grpo.loss import GRPOSettings
from zerofit.objectives.rloo.loss import (
    RLOOObjective,
    kl_penalty,
    leave_one_out_advantages,
    sequence_loss,
)

pytestmark = pytest.mark.slow

SETTINGS = GRPOSettings(epsilon=0.2)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One RLOOTrainer on the tiny model, fp32, beta 0 (built once)."""
    return trl_trainer("RLOO", tmp_path_factory.mktemp("trl"))


@pytest.mark.parametrize("normalize", [False, True])
def test_leave_one_out_advantages_are_trls(normalize: bool) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    grouped = rewards.view(-1, 4)
    expected = (rewards - ((grouped.sum(1, keepdim=True) - grouped) / 3).view(-1)).clone()
    if normalize:
        mean, std = expected.mean(), torch.sqrt(((expected - expected.mean()) ** 2).sum() / 7)
        expected = (expected - mean) / (std + 1e-4)
    ours = leave_one_out_advantages(rewards, 4, normalize)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)
    assert ours.abs().max() > 0.1
    # the group mean, not the leave-one-out one, is GRPO's: the same ordering, another scale
    assert not torch.allclose(ours, rewards - grouped.mean(1, keepdim=True).repeat_interleave(4, 0).view(-1))


@pytest.mark.parametrize("off_policy", [False, True])
def test_the_loss_is_trls_on_fixed_tensors(
    off_policy: bool, trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = fixed_tensors()
    old = t["logps"] - (2 * offsets(t["mask"]) if off_policy else 0.0)
    trl_logps = fixed_forward(trainer, monkeypatch, t["logps"])
    expected = trainer._compute_loss(trainer.model, trl_inputs(old_logps=(old * t["mask"]).sum(1)))
    expected.backward()
    logps = t["logps"].clone().requires_grad_()
    loss, clipped = sequence_loss(logps, old, ADVANTAGES, t["mask"].bool(), SETTINGS)
    loss.mean().backward()
    assert float(loss.mean()) == pytest.approx(float(expected), abs=1e-6)
    torch.testing.assert_close(logps.grad, trl_logps.grad, atol=1e-6, rtol=0)
    assert bool(clipped.any()) == off_policy


@pytest.mark.parametrize("off_policy", [False, True])
def test_the_loss_is_trls_on_a_model(off_policy: bool, trainer: Any) -> None:
    theirs = tiny_model()
    mask = completion_tensors()[2]
    old = completion_logps(theirs, adapters=True) - (2 * offsets(mask) if off_policy else 0.0)
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(theirs, outputs=("log_probs", "entropy"))
    expected, trl_grads = trl_step(trainer, theirs, trl_inputs(old_logps=old.sum(1)))
    loss, grads = zerofit_step(tiny_model(), RLOOObjective(SETTINGS), old if off_policy else None)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert len(grads) == len(trl_grads)
    for ours, trl_grad in zip(grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, trl_grad, atol=1e-6, rtol=1e-5)
    assert abs(expected) > 1e-3


@pytest.mark.parametrize("kept_old", [False, True])
def test_the_kl_penalty_is_trls(kept_old: bool) -> None:
    """rl.beta 0.05: each reward loses beta x sum_t (pi_old - pi_ref) (TRL's RLOO, computed inside its
    generation step, here by its formula on the same LoRA model), and `kl` is that log-ratio's token mean;
    pi_old the kept old log-probs when rl.num_iterations > 1, else the model's now."""
    model = lora_model(fused_head=False)
    mask = completion_tensors()[2]
    old = completion_logps(model, adapters=True) - (offsets(mask) if kept_old else 0.0)
    per_token_kl = (old - completion_logps(model, adapters=False)) * mask
    batches, indices = [], [[0, 1, 2], [3, 4, 5, 6, 7]]  # micro-batches of unequal sizes
    for micro in indices:
        batch = micro_batch(
            [PROMPTS[i // 4] for i in micro],
            [COMPLETIONS[i] for i in micro],
            [True] * len(micro),
            ADVANTAGES[micro],
            pad_id=0,
        )
        if kept_old:
            batch["old_logps"] = shifted_frame(old[micro], batch)
        batches.append(batch)
    settings = GRPOSettings(beta=0.05)
    penalty, metrics = kl_penalty(one_process_strategy(), model, batches, indices, 8, settings, "unchunked")
    torch.testing.assert_close(penalty, 0.05 * per_token_kl.sum(1).double(), atol=1e-6, rtol=0)
    assert metrics["kl"] == pytest.approx(float(per_token_kl.sum() / mask.sum()), abs=1e-6)
    assert penalty.abs().max() > 1e-3
