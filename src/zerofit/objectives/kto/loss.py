"""KTO (`train.objective: kto`, Ethayarajh et al. 2024): unpaired feedback, one completion per example, labelled
desirable or undesirable, against a reference point z0 that is the policy's KL from the reference.

Per example, with r = log pi(y|x) - log ref(y|x) (summed completion log-probs; pi the policy, ref the base
with the LoRA adapters off) and beta, w_d, w_u the `kto` section's beta, desirable_weight, undesirable_weight:

    desirable     w_d (1 - sigmoid(beta (r - z0)))
    undesirable   w_u (1 - sigmoid(beta (z0 - r)))
    loss          the sum of those over the global batch / the global batch's examples (TRL's mean)
    z0            max(0, mean over the global batch's examples k of log pi(y'_k|x_k) - log ref(y'_k|x_k)),
                  y'_k the completion of the example before k in the global batch (`zerofit.data.unpaired`);
                  detached (no gradient flows through it, as in TRL and the paper)

How it is exact whatever the split. `estimate_reference_point` runs before any backward of the step: a
no-grad forward of this rank's mismatched sequences through the policy and through the reference, their
summed differences and example count, ONE all-reduce, then z0; the pairing itself is fixed by the global
batch (`kto_micro_batches`). `counts` is the examples, all-reduced with the other normalizers as for every
objective. So micro x accumulation x ranks changes nothing: 8 x 1 and 2 x 4 on one process and 2 ranks give
the same loss. Packed micro-batches (`batch.tokens_per_micro_batch`: examples and their mismatched sequences
as segments of rows, `sequence_ids` / `kl_sequence_ids`) give the same per-example sums, so the same loss.

How TRL's KTOTrainer (1.16) differs. TRL rotates completions within each chunk of
`per_device_train_batch_size` examples of the dataset (at preparation, with a sequential sampler), so a
device's micro-batch pairs among itself; its z0 is that micro-batch's mean, gathered over devices and
averaged (`gather_for_metrics(kl).mean()`), then clamped, and its loss is the micro-batch's mean over
examples. With accumulation 1 on one device and the same example order the two are the same number; with
accumulation > 1, or micro-batches of different sizes, TRL's z0 and loss are per micro-batch, so its
step's loss depends on the split, and ours does not. Metrics follow TRL's names: `rewards/chosen` and
`logps/chosen` are means over the global batch's desirable examples (`rejected`: undesirable ones), present
only when the global batch has some (as TRL logs them), `rewards/margins` when it has both, and `kl` is z0
(TRL clamps the logged value too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerofit.objectives.logps import adapters_disabled, sequence_logps
from zerofit.objectives.protocol import Batch, Reducing
from zerofit.token_loss.fused import forward_token_losses

__all__ = ["KTO_METRICS", "KTOObjective", "KTOSettings", "kto_losses"]

# The per-example sums `terms` returns (fp64): turned into TRL's metrics by `KTOObjective.metric_means`.
_SUMS = ("rewards/chosen", "logps/chosen", "chosen", "rewards/rejected", "logps/rejected", "rejected")
# The metrics a KTO step logs (TRL's KTOTrainer names): see the module docstring for when each is present.
KTO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "kl",
)


@dataclass(frozen=True)
class KTOSettings:
    """The `kto` section as the objective reads it (TRL's KTOConfig names and defaults)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def kto_losses(
    logratios: torch.Tensor, desirable: torch.Tensor, z0: float | torch.Tensor, s: KTOSettings
) -> torch.Tensor:
    """Per example weighted KTO loss (TRL's `loss_type: kto`, the paper's Eq. 7) from r = pi - ref."""
    chosen = s.desirable_weight * (1 - F.sigmoid(s.beta * (logratios - z0)))
    rejected = s.undesirable_weight * (1 - F.sigmoid(s.beta * (z0 - logratios)))
    return torch.where(desirable.to(logratios.device), chosen, rejected)


def _kl_inputs(batch: Batch, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The mismatched sequences' model inputs and labels: their attention mask, or packed, their position
    ids and no mask (as `zerofit.data.batches.model_inputs` passes a packed micro-batch)."""
    layout = "kl_position_ids" if "kl_position_ids" in batch else "kl_attention_mask"
    inputs = {"input_ids": batch["kl_input_ids"].to(device), layout[3:]: batch[layout].to(device)}
    return inputs, batch["kl_labels"]


def _logps(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    ids: torch.Tensor | None,
    impl: str,
) -> torch.Tensor:
    """One forward's summed log-probs per sequence (per row, or per `sequence_ids` number when packed)."""
    return sequence_logps(forward_token_losses(model, inputs, labels, impl), labels, ids)[0]


class KTOObjective:  # its own before_window and metric_means (not UnitMeans')
    """KTO on `collate_unpaired` micro-batches (module docstring); `z0` is set per global batch by
    `estimate_reference_point` (or by the evaluation over the eval data) before `terms` runs."""

    metrics: tuple[str, ...] = _SUMS

    def __init__(self, settings: KTOSettings) -> None:
        self.s = settings
        self.z0 = 0.0

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """Examples of this rank's micro-batches (the loss is their mean over the global batch)."""
        return [sum(int(b["examples"]) for b in micro_batches)]

    def kl_sums(self, model: torch.nn.Module, batch: Batch, impl: str, device: torch.device) -> torch.Tensor:
        """(sum over the micro-batch's examples of policy - reference log-prob of the mismatched sequence,
        examples), fp64, no gradient: this micro-batch's share of z0."""
        m, ids = int(batch["examples"]), batch.get("kl_sequence_ids")
        inputs, labels = _kl_inputs(batch, device)
        with torch.no_grad():
            with adapters_disabled(model):
                reference = _logps(model, inputs, labels, ids, impl)
            policy = _logps(model, inputs, labels, ids, impl)
        diff = (policy - reference)[:m].double().sum()
        return torch.stack([diff, diff.new_tensor(float(m))])

    def before_window(
        self, strategy: Reducing, model: torch.nn.Module, micro_batches: list[Batch], impl: str
    ) -> None:
        """z0 of the global batch, before any backward (`estimate_reference_point`)."""
        self.estimate_reference_point(strategy, model, micro_batches, impl)

    def estimate_reference_point(
        self, strategy: Reducing, model: torch.nn.Module, micro_batches: list[Batch], impl: str
    ) -> float:
        """z0 of the global batch: this rank's `kl_sums` (every micro-batch, the empty one's dummy row too,
        so every rank runs the same forwards), one all-reduce, max(0, sum / examples). Sets and returns it."""
        local = torch.zeros(2, dtype=torch.float64, device=strategy.device)
        for batch in micro_batches:
            with strategy.accumulate(is_last=False):  # the training forward's context (autocast); no backward
                local += self.kl_sums(model, batch, impl, strategy.device)
        total, examples = strategy.all_reduce_sum(local).tolist()
        self.z0 = max(total / max(examples, 1.0), 0.0)
        return self.z0

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The reference's no-grad forward (adapters off), then the policy's: the micro-batch's weighted loss
        sum, and the detached per-example sums (`_SUMS`: rewards, log-probs and counts per label, fp64)."""
        labels, m, ids = batch["labels"], int(batch["examples"]), batch.get("sequence_ids")
        with torch.no_grad(), adapters_disabled(model):
            reference = _logps(model, inputs, labels, ids, impl)
        logps = _logps(model, inputs, labels, ids, impl)
        if m == 0:  # an empty micro-batch's dummy row: zero loss that still carries the graph
            return [logps.sum() * 0.0], logps.new_zeros(len(_SUMS), dtype=torch.float64)
        logratios = logps - reference
        desirable = batch["desirable"].to(logps.device)
        losses = kto_losses(logratios, desirable, self.z0, self.s)
        return [losses.sum()], self._metric_sums(
            logps.detach(), (self.s.beta * logratios).detach(), desirable
        )

    @staticmethod
    def _metric_sums(logps: torch.Tensor, rewards: torch.Tensor, desirable: torch.Tensor) -> torch.Tensor:
        """`_SUMS` over the micro-batch: per label, the rewards' and log-probs' sums and the count (fp64)."""
        values = []
        for side in (desirable, ~desirable):
            values += [rewards[side].double().sum(), logps[side].double().sum(), side.double().sum()]
        return torch.stack(values)

    def metric_means(self, sums: list[float], units: int = 0, prefix: str = "") -> dict[str, float]:
        """TRL's metrics from the global batch's `_SUMS` (each label counts its own examples, so `units` is
        not needed): means per label where it has examples, the margin where it has both, and `kl` (z0)."""
        reward_c, logp_c, n_c, reward_r, logp_r, n_r = sums
        out: dict[str, float] = {}
        if n_c:
            out |= {f"{prefix}rewards/chosen": reward_c / n_c, f"{prefix}logps/chosen": logp_c / n_c}
        if n_r:
            out |= {f"{prefix}rewards/rejected": reward_r / n_r, f"{prefix}logps/rejected": logp_r / n_r}
        if n_c and n_r:
            out[f"{prefix}rewards/margins"] = reward_c / n_c - reward_r / n_r
        out[f"{prefix}kl"] = self.z0
        return out
