"""The fixed batch and the plumbing that puts zerofit's RL losses beside TRL 1.16's trainers
(tests/unit/objectives/test_grpo_trl.py, test_rloo_trl.py): two prompts of one length (TRL gives the model no
position ids; zerofit counts real tokens only, the same without left padding), eight completions of 1 to 4
tokens, fixed advantages; TRL's inputs in its completion frame, zerofit's micro-batch in the shifted frame,
and each side's loss and gradient."""

from __future__ import annotations

from typing import Any

import torch

from config_helpers import one_process_strategy
from zerofit.loop.rollout import micro_batch
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.protocol import Objective

PROMPTS = [[1, 40, 41, 42], [1, 50, 51, 52]]
COMPLETIONS = [[60, 61, 2], [62], [63, 64, 65, 66], [67, 2], [70, 71], [72, 73, 74], [75], [76, 77, 78, 2]]
ADVANTAGES = torch.tensor([0.9, -0.3, 1.2, -1.8, 0.4, -0.7, 1.1, -0.5])  # not centred: a non-zero loss
MAX_COMPLETION = 5


def tiny_model() -> Any:
    """The tiny Llama in fp32, the same weights every call."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(), dtype=torch.float32)


def trl_trainer(kind: str, tmp_path: Any) -> Any:
    """TRL's `kind` trainer (`GRPO` or `RLOO`) on the tiny model in fp32 (TRL's `bf16=True` default autocasts
    its forward even on CPU), beta 0, G 4 over 8 completions, a reward of 0: the tests set the settings and
    feed the inputs themselves. Accumulation 1, as Trainer's loop would set it."""
    import pytest

    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from zerofit.models.tiny import build_tokenizer

    args = getattr(trl, f"{kind}Config")(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        beta=0.0,
        bf16=False,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
    )
    built = getattr(trl, f"{kind}Trainer")(
        model=tiny_model(),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 8),
        processing_class=build_tokenizer(),
    )
    built.current_gradient_accumulation_steps = 1
    built.model.train()
    return built


def lora_model(fused_head: bool) -> Any:
    """The tiny model with random (nonzero) LoRA adapters, the same every call; TRL's copy gets its fused
    lm_head before the wrapping, as TRL does it."""
    import peft

    base = tiny_model()
    if fused_head:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(base, outputs=("log_probs", "entropy"))
    torch.manual_seed(0)
    targets = ["q_proj", "v_proj", "down_proj"]  # not lm_head: TRL's fused head reads its base weight
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))


def completion_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's layout: prompt ids [8, 4] and right-padded completion ids and mask [8, 4]."""
    width = max(len(c) for c in COMPLETIONS)
    ids = torch.zeros(len(COMPLETIONS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(COMPLETIONS):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    return torch.tensor([PROMPTS[i // 4] for i in range(len(COMPLETIONS))]), ids, mask


def offsets(mask: torch.Tensor) -> torch.Tensor:
    """Fixed log-ratio offsets in [-0.3, 0.3]: the old policy's distance (some ratios leave [0.8, 1.2])."""
    k = torch.arange(mask.numel(), dtype=torch.float32).view_as(mask)
    return 0.3 * torch.sin(1.7 * k + 0.5) * mask


def trl_inputs(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's `_compute_loss` inputs for the fixed batch, plus `extra` (old / reference log-probs)."""
    prompts, ids, mask = completion_tensors()
    return {
        "prompt_ids": prompts,
        "prompt_mask": torch.ones_like(prompts),
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": ADVANTAGES,
        "num_items_in_batch": mask.sum(),
        **extra,
    }


def trl_step(trainer: Any, model: Any, inputs: dict[str, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    """TRL's `_compute_loss` on `model` and its gradient (the trainable parameters', in order)."""
    model.train()
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def shifted_frame(per_token: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TRL's [rows, completion] log-probs in zerofit's shifted [rows, seq] frame of `batch` (token t at t - 1;
    the prompts here have one length)."""
    p = len(PROMPTS[0])
    out = torch.zeros(batch["input_ids"].shape)
    out[:, p - 1 : p - 1 + per_token.size(1)] = per_token
    return out


def zerofit_step(
    model: Any, objective: Objective, old: torch.Tensor | None
) -> tuple[float, list[torch.Tensor]]:
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
    if old is not None:
        batch["old_logps"] = shifted_frame(old, batch)
    grads: list[torch.Tensor] = []
    hook = strategy.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.extend(
            p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None
        )
    )
    result = train_step(strategy, model, [batch], None, "unchunked", objective)
    hook.remove()
    return result.loss, grads


def completion_logps(model: Any, adapters: bool) -> torch.Tensor:
    """Per completion token log-probs [8, 4] by a plain fp32 forward (0 at padding)."""
    prompts, ids, mask = completion_tensors()
    full = torch.cat([prompts, ids], dim=1)
    with torch.no_grad():
        if adapters:
            logits = model(input_ids=full).logits
        else:
            with model.disable_adapter():
                logits = model(input_ids=full).logits
    logp = torch.log_softmax(logits[:, prompts.size(1) - 1 : -1].float(), dim=-1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask


def fixed_tensors() -> dict[str, torch.Tensor]:
    """Log-probs, old and reference log-probs [8, 4] in TRL's completion frame, its mask and advantages."""
    mask = completion_tensors()[2]
    gen = torch.Generator().manual_seed(7)
    logps = -torch.rand(mask.shape, generator=gen) * 3 * mask
    return {
        "logps": logps,
        "old": logps - offsets(mask),
        "ref": logps + 0.5 * torch.randn(mask.shape, generator=gen) * mask,
        "mask": mask,
    }


def fixed_forward(trainer: Any, monkeypatch: Any, logps: torch.Tensor) -> torch.Tensor:
    """TRL's per-token forward replaced (for the test) by the fixed `logps` [8, 4]: returns the leaf TRL's
    loss will differentiate."""
    leaf = logps.clone().requires_grad_()
    fixed = (leaf, torch.zeros_like(leaf), None)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: fixed)
    return leaf
