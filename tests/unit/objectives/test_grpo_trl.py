"""zerofit's GRPO loss and gradient equal TRL 1.16's GRPOTrainer `_compute_loss`, TRL in fp32 (`bf16=False`).

The same tiny model, prompts, fixed completions and advantages go through `GRPOTrainer._compute_loss` and
through `train_step` with `GRPOObjective`:

- each loss type at beta 0, on-policy (TRL's old log-probs are the detached current ones, as zerofit's):
  the losses within 1e-6, the gradient norms within rel 1e-5 of each other and of the definition's by plain
  autograd (full fp32 log-softmax);
- beta 0.04 off-policy (the old log-probs of `rl.num_iterations` 2's second update: the rollout's, here the
  current ones moved by fixed offsets up to 0.3, so some ratios clip), `use_bias_correction_kl` both ways, on
  a LoRA model whose adapters (random, nonzero) make the reference (adapters off) differ, and GSPO
  (`importance_sampling_level: sequence`) the same way: the losses within 1e-6, every gradient element within
  1e-5 + rel 1e-4;
- the same settings on fixed tensors (log-probs, old and reference log-probs, a mask and advantages, no
  model): the per-token loss `token_loss` reduced as TRL's grpo, its value within 1e-6 and its gradient
  with respect to the log-probs within 1e-6 of TRL's; GSPO-token (`sequence_token`, not in TRL 1.16) there
  equals TRL's `sequence` at beta 0, value and gradient, as its paper says.

The ~3e-4 gradient gap this test used to hold to 1e-3 was TRL's `bf16=True` default: on CPU it autocasts TRL's
forward (log-probs ~5e-3 off); in fp32 TRL's fused lm_head agrees with zerofit to ~1e-7.

Definitional differences, avoided here: TRL gives the model no position ids, so a left-padded prompt's
positions count its padding (zerofit counts real tokens only): the prompts here have one length; TRL normalizes
grpo / dr_grpo per micro-batch and divides by the accumulation steps (the same at accumulation 1, and whenever
every micro-batch has as many completions).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.loop.rollout import micro_batch
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.grpo.loss import GRPOObjective, GRPOSettings, token_loss

pytestmark = pytest.mark.slow

PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52]]
COMPLETIONS = [[60, 61, 2], [62], [63, 64, 65, 66], [67, 2], [70, 71], [72, 73, 74], [75], [76, 77, 78, 2]]
ADVANTAGES = torch.tensor([0.9, -0.3, 1.2, -1.8, 0.4, -0.7, 1.1, -0.5])  # not centred: a non-zero loss
MAX_COMPLETION = 5
BETA = 0.04
# (importance_sampling_level, use_bias_correction_kl) at beta 0.04, off-policy
KL_CASES = [("token", True), ("token", False), ("sequence", True), ("sequence", False)]


def _model() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(), dtype=torch.float32)


def _lora_model(fused_head: bool) -> Any:
    """The tiny model with random (nonzero) LoRA adapters, the same every call; TRL's copy gets its fused
    lm_head before the wrapping, as TRL does it."""
    import peft

    base = _model()
    if fused_head:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(base, outputs=("log_probs", "entropy"))
    torch.manual_seed(0)
    targets = ["q_proj", "v_proj", "down_proj"]  # not lm_head: TRL's fused head reads its base weight
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One GRPOTrainer on the tiny model, fp32 (built once: ~15 s); each test sets its loss settings."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from zerofit.models.tiny import build_tokenizer

    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        beta=0.0,
        bf16=False,
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
    built.model.train()
    return built


def _configure(trainer: Any, monkeypatch: pytest.MonkeyPatch, s: GRPOSettings) -> None:
    """TRL's attributes for the settings `s` (undone after the test)."""
    monkeypatch.setattr(trainer, "loss_type", s.loss_type)
    monkeypatch.setattr(trainer, "beta", s.beta)
    monkeypatch.setattr(trainer, "importance_sampling_level", s.importance_sampling_level)
    monkeypatch.setattr(trainer.args, "use_bias_correction_kl", s.use_bias_correction_kl)


def _completion_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's layout: prompt ids [8, 4] and right-padded completion ids and mask [8, 4]."""
    width = max(len(c) for c in COMPLETIONS)
    ids = torch.zeros(len(COMPLETIONS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(COMPLETIONS):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    return torch.tensor([PROMPTS[i // 4] for i in range(len(COMPLETIONS))]), ids, mask


def _offsets(mask: torch.Tensor) -> torch.Tensor:
    """Fixed log-ratio offsets in [-0.3, 0.3]: the old policy's distance (some ratios leave [0.8, 1.2])."""
    k = torch.arange(mask.numel(), dtype=torch.float32).view_as(mask)
    return 0.3 * torch.sin(1.7 * k + 0.5) * mask


def _completion_logps(model: Any, adapters: bool) -> torch.Tensor:
    """Per completion token log-probs [8, 4] by a plain fp32 forward (0 at padding)."""
    prompts, ids, mask = _completion_tensors()
    full = torch.cat([prompts, ids], dim=1)
    with torch.no_grad():
        if adapters:
            logits = model(input_ids=full).logits
        else:
            with model.disable_adapter():
                logits = model(input_ids=full).logits
    logp = torch.log_softmax(logits[:, prompts.size(1) - 1 : -1].float(), dim=-1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask


def _trl_inputs(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    prompts, ids, mask = _completion_tensors()
    return {
        "prompt_ids": prompts,
        "prompt_mask": torch.ones_like(prompts),
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": ADVANTAGES,
        "num_items_in_batch": mask.sum(),
        **extra,
    }


def _trl_step(trainer: Any, model: Any, inputs: dict[str, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    """TRL's `_compute_loss` on `model` and its gradient (the trainable parameters', in order)."""
    model.train()
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _zerofit_step(model: Any, s: GRPOSettings, old: torch.Tensor | None) -> tuple[float, list[torch.Tensor]]:
    """zerofit's `train_step` (lr 0) on `model` with the fixed completions, and its gradient."""
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    batch = micro_batch(
        [PROMPTS[i // 4] for i in range(len(COMPLETIONS))], COMPLETIONS, [True] * 8, ADVANTAGES, pad_id=0
    )
    if old is not None:  # TRL's [8, completion] frame -> the shifted [8, seq] frame (token t at t - 1)
        p = len(PROMPTS[0])
        batch["old_logps"] = torch.zeros(batch["input_ids"].shape)
        batch["old_logps"][:, p - 1 : p - 1 + old.size(1)] = old
    grads: list[torch.Tensor] = []
    hook = strategy.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.extend(
            p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None
        )
    )
    result = train_step(strategy, model, [batch], None, "unchunked", GRPOObjective(s))
    hook.remove()
    return result.loss, grads


def _trl_grad_norm(trainer: Any, loss_type: str, monkeypatch: pytest.MonkeyPatch) -> tuple[float, float]:
    _configure(trainer, monkeypatch, GRPOSettings(loss_type=loss_type))
    loss, grads = _trl_step(trainer, trainer.model, _trl_inputs())
    return loss, float(torch.cat([g.flatten() for g in grads]).norm())


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
def test_the_loss_is_trls(loss_type: str, trainer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    expected, grad_norm = _trl_grad_norm(trainer, loss_type, monkeypatch)
    settings = GRPOSettings(loss_type=loss_type, max_completion_length=MAX_COMPLETION)
    loss, grads = _zerofit_step(_model(), settings, None)
    norm = float(torch.cat([g.flatten() for g in grads]).norm())
    assert loss == pytest.approx(expected, abs=1e-6)
    assert norm == pytest.approx(_definition_grad_norm(loss_type), rel=1e-5)
    assert norm == pytest.approx(grad_norm, rel=1e-5)  # TRL in fp32 (module docstring)
    assert abs(expected) > 1e-3  # not a vacuous zero


@pytest.mark.parametrize(("level", "bias_correction"), KL_CASES)
def test_beta_off_policy_is_trls_on_a_model(
    level: str, bias_correction: bool, trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """beta 0.04, the second update of rl.num_iterations 2 (old log-probs apart), the KL correction either
    way, the token ratio and GSPO's: TRL's loss and every gradient element, on one LoRA model."""
    s = GRPOSettings(
        loss_type="grpo",
        beta=BETA,
        max_completion_length=MAX_COMPLETION,
        use_bias_correction_kl=bias_correction,
        importance_sampling_level=level,
    )
    _configure(trainer, monkeypatch, s)
    theirs = _lora_model(fused_head=True)
    mask = _completion_tensors()[2]
    old = _completion_logps(theirs, adapters=True) - _offsets(mask)
    ref = _completion_logps(theirs, adapters=False)
    expected, trl_grads = _trl_step(
        trainer, theirs, _trl_inputs(old_per_token_logps=old, ref_per_token_logps=ref)
    )
    loss, grads = _zerofit_step(_lora_model(fused_head=False), s, old)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert len(grads) == len(trl_grads)
    for ours, trl_grad in zip(grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, trl_grad, atol=1e-5, rtol=1e-4)
    assert abs(expected) > 1e-4 and max(float(g.abs().max()) for g in grads) > 1e-3  # not vacuous


def _fixed_tensors() -> dict[str, torch.Tensor]:
    """Log-probs, old and reference log-probs [8, 4] in TRL's completion frame, its mask and advantages."""
    mask = _completion_tensors()[2]
    gen = torch.Generator().manual_seed(7)
    logps = -torch.rand(mask.shape, generator=gen) * 3 * mask
    return {
        "logps": logps,
        "old": logps - _offsets(mask),
        "ref": logps + 0.5 * torch.randn(mask.shape, generator=gen) * mask,
        "mask": mask,
    }


def _on_fixed_tensors(
    trainer: Any, monkeypatch: pytest.MonkeyPatch, theirs: GRPOSettings, ours: GRPOSettings
) -> tuple[torch.Tensor, ...]:
    """TRL's grpo loss at `theirs` (its forward replaced by the fixed log-probs) and `token_loss` at `ours`
    reduced as TRL's grpo: (TRL's loss, its gradient w.r.t. the log-probs, zerofit's loss, its gradient)."""
    t = _fixed_tensors()
    _configure(trainer, monkeypatch, theirs)
    trl_logps = t["logps"].clone().requires_grad_()
    fixed = (trl_logps, torch.zeros_like(trl_logps), None)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: fixed)
    inputs = _trl_inputs(old_per_token_logps=t["old"], ref_per_token_logps=t["ref"])
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()
    logps, mask = t["logps"].clone().requires_grad_(), t["mask"].bool()
    per_token, _, _ = token_loss(logps, t["old"], ADVANTAGES, t["ref"] if ours.beta > 0 else None, ours, mask)
    loss = (per_token.where(mask, 0.0).sum(dim=1) / mask.sum(dim=1)).mean()
    loss.backward()
    return expected.detach(), trl_logps.grad, loss.detach(), logps.grad


@pytest.mark.parametrize(("level", "bias_correction"), KL_CASES)
def test_beta_off_policy_is_trls_on_fixed_tensors(
    level: str, bias_correction: bool, trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same settings on fixed log-probs: `token_loss`'s value and gradient w.r.t. the log-probs."""
    s = GRPOSettings(
        loss_type="grpo", beta=BETA, use_bias_correction_kl=bias_correction, importance_sampling_level=level
    )
    expected, trl_grad, loss, grad = _on_fixed_tensors(trainer, monkeypatch, s, s)
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    torch.testing.assert_close(grad, trl_grad, atol=1e-6, rtol=0)


def test_gspo_token_is_gspo_with_per_completion_advantages(
    trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GSPO-token (`sequence_token`, not in TRL 1.16) has GSPO's value and, with one advantage per
    completion and beta 0, GSPO's gradient (Zheng et al. 2025): TRL's `sequence` on fixed tensors; the token
    ratio's gradient differs."""
    gspo = GRPOSettings(loss_type="grpo", importance_sampling_level="sequence")
    token_level = GRPOSettings(loss_type="grpo", importance_sampling_level="sequence_token")
    expected, trl_grad, loss, grad = _on_fixed_tensors(trainer, monkeypatch, gspo, token_level)
    assert float(loss) == pytest.approx(float(expected), abs=1e-6)
    torch.testing.assert_close(grad, trl_grad, atol=1e-6, rtol=0)
    _, _, _, per_token_grad = _on_fixed_tensors(trainer, monkeypatch, gspo, GRPOSettings(loss_type="grpo"))
    assert float((per_token_grad - trl_grad).abs().max()) > 1e-2
