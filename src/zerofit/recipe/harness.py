"""`eval.harness` wired into a run: its settings from the config, and rank 0's evaluation copy of the model
(the base as the run loaded it plus the run's own LoRA adapters, `zerofit.trained.model`), which
`zerofit.harness.during` fills with each evaluated step's gathered weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerofit.engine_spec.run_plan import RunPlan
from zerofit.strategies.base import Strategy

if TYPE_CHECKING:
    from zerofit.harness.during import HarnessDuringTraining

__all__ = ["harness_for"]


def harness_for(plan: RunPlan, strategy: Strategy, tokenizer: Any) -> HarnessDuringTraining | None:
    """The run's `eval.harness` (None when `eval.harness.tasks` is empty)."""
    cfg = plan.config
    h = cfg.eval.harness
    if not h.tasks:
        return None  # (the harness's modules are imported by the runs that evaluate with it)
    from zerofit.harness.during import HarnessDuringTraining
    from zerofit.harness.evaluate import HarnessSettings

    assert cfg.train.max_steps is not None, "a run plan knows its step count"
    chat = h.apply_chat_template if h.apply_chat_template is not None else cfg.data.format == "messages"
    limit = int(h.limit) if h.limit is not None and h.limit >= 1 else h.limit
    settings = HarnessSettings(tuple(h.tasks), limit, None, h.batch_size, chat)

    def build_copy() -> tuple[Any, Any]:
        from zerofit.trained.model import load_base, with_run_adapters

        device = strategy.device
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        model = load_base(cfg, dtype, device)
        if cfg.lora.enabled:
            model = with_run_adapters(model, cfg).to(dtype)
        return model.eval(), tokenizer

    return HarnessDuringTraining(
        strategy, settings, h.every_steps, cfg.train.max_steps, plan.run_dir, build_copy
    )
