"""On-policy distillation's loss (`train.objective: gkd`): the generalized Jensen-Shannon divergence between the
student's and the teacher's next-token distributions, per completion token, over the whole vocabulary.

With s = log softmax(student logits), t = log softmax(teacher logits) at one position (TRL GKDTrainer's
`generalized_jsd_loss`, Eq. 1 of Agarwal et al. 2024; torch's `kl_div(input, target)` is KL(target || input)):

    beta = 0   KL(teacher || student)                     forward KL (the data's distillation, mode covering)
    beta = 1   KL(student || teacher)                     reverse KL (mode seeking: Qwen3's and Thinking
                                                          Machines' on-policy distillation)
    else       beta KL(teacher || m) + (1 - beta) KL(student || m),  m = (1 - beta) student + beta teacher

and the loss is the token sum over the global batch's completion tokens divided by their number (TRL's
`num_items_in_batch` normalization): one `count`, all-reduced once per global batch by the train step, so the
loss and its gradient are the same for every micro x accumulation x data-parallel split. The loss is at
temperature 1 as TRL's `compute_loss` calls it (`gkd` sampling's temperature is `rl.temperature`).

The micro-batch is the rollout's (`zerofit.loop.distill`): `input_ids`, `attention_mask`, `position_ids`,
`labels` (the completion tokens, IGNORE_INDEX elsewhere), as GRPO's without its advantages. The teacher is a
frozen model on the rank's device (`zerofit.recipe.teacher`), attached once the run has loaded it; it runs
without gradients, in eval mode, on the same token ids (the tokenizers are one, checked at load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerofit.objectives.grpo.loss import grpo_inputs, trained_mask
from zerofit.objectives.protocol import Batch, UnitMeans

__all__ = ["GKDObjective", "GKDSettings", "generalized_jsd"]


@dataclass(frozen=True)
class GKDSettings:
    """The `gkd` section as the loss reads it."""

    beta: float = 0.5


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """The per-position generalized JSD (module docstring), [..., vocab] logits in, [...] fp32 out: TRL's
    `generalized_jsd_loss` before its masking and reduction, term by term."""
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(dim=-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(dim=-1)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    kl_teacher = F.kl_div(mixture, t, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture, s, reduction="none", log_target=True)
    return (b * kl_teacher + (1 - b) * kl_student).sum(dim=-1)


class GKDObjective(UnitMeans):
    """The GKD loss on rollout micro-batches (module docstring); `teacher` is set by the run."""

    def __init__(self, settings: GKDSettings, teacher: torch.nn.Module | None = None) -> None:
        self.s = settings
        self.teacher = teacher

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """This rank's completion tokens (the loss's normalizer)."""
        return [sum(int(trained_mask(b).sum()) for b in micro_batches)]

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The micro-batch's divergence summed over its completion tokens, and no metrics."""
        if self.teacher is None:
            raise ValueError("the GKD objective has no teacher: the run attaches it (zerofit.recipe.teacher)")
        device = inputs["input_ids"].device
        inputs = grpo_inputs(batch, device)
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs, use_cache=False).logits
        student_logits = model(**inputs, use_cache=False).logits
        mask = trained_mask(batch).to(device)
        per_token = generalized_jsd(student_logits[mask], teacher_logits[mask], self.s.beta)
        return [per_token.sum()], torch.zeros(0, dtype=torch.float64)
