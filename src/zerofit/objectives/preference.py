"""What a micro-batch contributes to the loss, per `train.objective`: SFT's token sums or a preference loss.

The train step (`zerofit.loop.train.train_step`) and the evaluation (`zerofit.loop.evaluate`) see an objective as

    counts(micro_batches)   this rank's normalizers (ints), all-reduced once over the global batch before
                            any backward;
    terms(model, ...)       one micro-batch's differentiable *sums*, one per normalizer, and the detached
                            per-pair sums of the metrics (`METRICS`);

and the global loss is sum_k term_k / count_k. So nothing depends on the split: every sum is over the
micro-batch's own units, every normalizer is the whole global batch's (docs/design.md).

    sft    one term, the token-loss sum; normalized by the global batch's valid label tokens.
    dpo    per pair: TRL's losses of the margin m = (pi_c - pi_r) - (ref_c - ref_r) of summed response
           log-probs (pi policy, ref reference): sigmoid -logsig(b m)(1 - ls) - logsig(-b m) ls,
           hinge relu(1 - b m), ipo (m - 1/(2b))^2 on per-token *mean* log-probs (as TRL's IPO);
           normalized by the global batch's pairs. Rewards b (pi - ref).
    simpo  per pair -logsig(b (pbar_c - pbar_r) - gamma), gamma the target margin itself (TRL's
           `simpo_gamma`), pbar the mean response log-prob (label smoothing as DPO's); no reference.
           Rewards b pbar.
    orpo   NLL of the chosen sequences, summed, normalized by the global batch's tokens it is over (TRL's
           token mean over the batch, made global): with `prompt_loss` (TRL's and the ORPO authors'
           default) every token of the chosen sequence, prompt included (position 0 predicts nothing),
           else the chosen response tokens only; plus lambda x per pair -logsig(log-odds), log-odds =
           (pbar_c - pbar_r) - (log(1 - e^pbar_c) - log(1 - e^pbar_r)) on the responses' mean
           log-probs, normalized by the global batch's pairs. Rewards lambda pbar (TRL's beta is ORPO's
           lambda).

A preference micro-batch is `zerofit.data.pairs.collate_pairs`' 2m rows (chosen, then rejected) and one
forward; per-row log-probs are sums of `forward_token_losses` (the chunked loss, or inside lm_head for
`fused_linear`: one fp32 number per token, never full fp32 logits). The reference is, per
`preference.reference`: `adapters_off` the same model with its LoRA adapters disabled (peft's
`disable_adapter`, no gradients, before the policy forward, on every micro-batch, the dummy row of an
empty one included so every rank runs the same forwards); `precomputed` the batch's `reference_logps`
(`zerofit.loop.reference`); `none` for SimPO and ORPO.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from zerofit.objectives.fused_loss import forward_token_losses, forward_token_sum
from zerofit.objectives.loss import IGNORE_INDEX, batch_labels, count_label_tokens, shifted_targets

__all__ = [
    "METRICS",
    "Objective",
    "PreferenceObjective",
    "PreferenceSettings",
    "SFTObjective",
    "adapters_disabled",
    "dpo_losses",
    "means_of",
    "orpo_losses",
    "orpo_nll_labels",
    "row_logps",
    "simpo_losses",
]

# The per-step metrics of a preference objective, TRL's names: means over the global batch's pairs.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

Batch = dict[str, torch.Tensor]


class Objective(Protocol):
    """What the train step and the evaluation need of `train.objective` (module docstring)."""

    metrics: tuple[str, ...]  # names of the per-pair metric sums `terms` returns (empty for SFT)

    def counts(self, micro_batches: list[Batch]) -> list[int]: ...

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]: ...


class SFTObjective:
    """Next-token loss on the responses: one token sum per micro-batch over the global valid tokens."""

    metrics: tuple[str, ...] = ()

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """Valid label tokens of this rank's micro-batches."""
        return [sum(count_label_tokens(*batch_labels(b)) for b in micro_batches)]

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The micro-batch's token-loss sum (`zerofit.objectives.fused_loss.forward_token_sum`); no metrics."""
        labels, shifted = batch_labels(batch)  # a sequence-parallel shard's are shifted already
        loss_sum = forward_token_sum(model, inputs, labels, impl, shifted)
        return [loss_sum], loss_sum.new_zeros(0, dtype=torch.float64)


@dataclass(frozen=True)
class PreferenceSettings:
    """The `preference` section as the objective reads it (`objective` is train.objective)."""

    objective: str  # dpo | simpo | orpo
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    # SimPO's target margin gamma itself (TRL's simpo_gamma), not gamma / beta; the run passes the config's
    # `PreferenceSection.simpo_margin()` (home of its default), so this one is only "no margin".
    simpo_gamma: float = 0.0
    orpo_lambda: float = 0.1
    orpo_prompt_loss: bool = True  # ORPO's NLL over the chosen prompt too (TRL's, the ORPO authors' default)
    reference: str = "none"  # adapters_off | precomputed | none (resolved, never auto here)


def row_logps(token_nll: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its valid label tokens, and how many there are (fp32).

    `token_nll` is `forward_token_losses`' [rows, seq] (0 where nothing is predicted), so the sum is a
    plain reduction; the count is of labels 1.. (position 0 predicts nothing), as `count_label_tokens`.
    """
    counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).to(token_nll.device, torch.float32)
    return -token_nll.sum(dim=1), counts


def _logsig_smoothed(x: torch.Tensor, smoothing: float) -> torch.Tensor:
    """-log sigmoid(x), with conservative label smoothing (the assumed rate of flipped labels)."""
    return -F.logsigmoid(x) * (1 - smoothing) - F.logsigmoid(-x) * smoothing


def dpo_losses(
    policy: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per pair DPO loss from (chosen, rejected) log-probs of the policy and the reference (TRL's)."""
    margin = (policy[0] - policy[1]) - (reference[0] - reference[1])
    if loss_type == "sigmoid":
        return _logsig_smoothed(beta * margin, label_smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin)
    if loss_type == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    raise ValueError(f"preference.loss_type {loss_type!r}: expected sigmoid, ipo or hinge")


def simpo_losses(
    mean_logps: tuple[torch.Tensor, torch.Tensor],
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per pair SimPO loss from mean response log-probs: -logsig(beta (c - r) - gamma), `gamma` the target
    reward margin itself (TRL's `simpo_gamma`; the SimPO authors' gamma_beta_ratio is gamma / beta)."""
    return _logsig_smoothed(beta * (mean_logps[0] - mean_logps[1]) - gamma, label_smoothing)


def orpo_losses(mean_logps: tuple[torch.Tensor, torch.Tensor], lam: float) -> torch.Tensor:
    """Per pair ORPO odds-ratio term, lambda x -logsig(log odds(chosen) - log odds(rejected)).

    log odds(p) = log p - log(1 - p) of the mean response log-prob; `log1p(-exp(.))` is exact near 0.
    """
    chosen, rejected = mean_logps
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return -lam * F.logsigmoid(log_odds)


def orpo_nll_labels(batch: Batch, prompt_loss: bool) -> torch.Tensor:
    """The labels ORPO's NLL is over, for the chosen rows (the first `pairs`): their response labels, or
    with `prompt_loss` every real token of the chosen sequence (prompt included, padding never), as TRL's
    ORPO and the ORPO authors' default."""
    m = int(batch["pairs"])
    if not prompt_loss:
        return batch["labels"][:m]
    real = batch["attention_mask"][:m] == 1
    return torch.where(real, batch["input_ids"][:m], torch.full_like(batch["input_ids"][:m], IGNORE_INDEX))


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The PeftModel inside `model` (DeepSpeed's `.module`, DDP's `.module`, FSDP2's module itself) with
    its adapters switched off: the frozen base, with no second copy of it."""
    from peft import PeftModel

    peft_model = next((m for m in model.modules() if isinstance(m, PeftModel)), None)
    if peft_model is None:
        raise ValueError("preference.reference = adapters_off on a model without LoRA adapters")
    with peft_model.disable_adapter():
        yield


class PreferenceObjective:
    """DPO, SimPO or ORPO on `collate_pairs` micro-batches (module docstring)."""

    metrics: tuple[str, ...] = METRICS

    def __init__(self, settings: PreferenceSettings) -> None:
        self.s = settings

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """Pairs of this rank's micro-batches (ORPO: and the chosen tokens its NLL is over)."""
        pairs = sum(int(b["pairs"]) for b in micro_batches)
        if self.s.objective != "orpo":
            return [pairs]
        chosen = sum(count_label_tokens(orpo_nll_labels(b, self.s.orpo_prompt_loss)) for b in micro_batches)
        return [chosen, pairs]

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One forward of the micro-batch's 2m rows (after the reference's, for adapters_off): the loss
        sums (one per count) and the detached per-pair metric sums (`METRICS`, fp64)."""
        labels, m = batch["labels"], int(batch["pairs"])
        reference = self._reference(model, inputs, batch, impl)
        prompt_nll = self.s.objective == "orpo" and self.s.orpo_prompt_loss and m > 0
        if prompt_nll:  # one forward scores the chosen rows' prompts too; the responses are picked out
            token_nll = forward_token_losses(model, inputs, self._orpo_forward_labels(batch), impl)
            chosen_nll = token_nll[:m].sum()
            response = shifted_targets(labels).reshape(labels.shape) != IGNORE_INDEX
            token_nll = token_nll.where(response.to(token_nll.device), 0.0)
        else:
            token_nll = forward_token_losses(model, inputs, labels, impl)
        logps, lengths = row_logps(token_nll, labels)
        if m == 0:  # an empty micro-batch's dummy row: zero loss that still carries the graph
            zero = logps.sum() * 0.0
            return [zero] * len(self.counts([batch])), zero.new_zeros(len(METRICS), dtype=torch.float64)
        losses, rewards, shown = self._pair_losses(logps, lengths, reference, m)
        terms = [losses.sum()]
        if self.s.objective == "orpo":  # the chosen NLL (over `counts`' chosen tokens), the odds-ratio term
            terms = [chosen_nll if prompt_nll else -logps[:m].sum(), terms[0]]
        return terms, self._metric_sums(rewards, shown)

    def _orpo_forward_labels(self, batch: Batch) -> torch.Tensor:
        """The labels of ORPO's one forward with the prompt loss: the chosen rows' `orpo_nll_labels`, the
        rejected rows' own."""
        m = int(batch["pairs"])
        return torch.cat([orpo_nll_labels(batch, prompt_loss=True), batch["labels"][m:]])

    def _reference(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> torch.Tensor | None:
        """The reference's summed log-probs of the 2m rows (None: no reference)."""
        if self.s.reference == "precomputed":
            if "reference_logps" not in batch:
                if int(batch["pairs"]) == 0:
                    return None
                raise ValueError(
                    "preference.reference = precomputed, and a micro-batch has no reference_logps"
                )
            return batch["reference_logps"].to(inputs["input_ids"].device, torch.float32)
        if self.s.reference != "adapters_off":
            return None
        with torch.no_grad(), adapters_disabled(model):
            return row_logps(forward_token_losses(model, inputs, batch["labels"], impl), batch["labels"])[0]

    def _pair_losses(
        self, logps: torch.Tensor, lengths: torch.Tensor, reference: torch.Tensor | None, m: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Per pair losses, (chosen, rejected) rewards, and the (chosen, rejected) log-probs shown."""
        s = self.s
        means = logps / lengths.clamp(min=1)
        mean_pair = (means[:m], means[m:])
        if s.objective == "simpo":
            return (
                simpo_losses(mean_pair, s.beta, s.simpo_gamma, s.label_smoothing),
                _times(s.beta, mean_pair),
                mean_pair,
            )
        if s.objective == "orpo":
            return orpo_losses(mean_pair, s.orpo_lambda), _times(s.orpo_lambda, mean_pair), mean_pair
        if reference is None:
            raise ValueError("train.objective = dpo needs a reference (preference.reference)")
        policy = (logps[:m], logps[m:])
        ref = (reference[:m], reference[m:])
        rewards = _times(s.beta, (policy[0] - ref[0], policy[1] - ref[1]))
        if s.loss_type == "ipo":  # TRL's IPO: per-token mean log-probs
            policy = mean_pair
            ref = (ref[0] / lengths[:m].clamp(min=1), ref[1] / lengths[m:].clamp(min=1))
        return (
            dpo_losses(policy, ref, s.beta, s.loss_type, s.label_smoothing),
            rewards,
            (logps[:m], logps[m:]),
        )

    @staticmethod
    def _metric_sums(
        rewards: tuple[torch.Tensor, torch.Tensor], shown: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Sums over the micro-batch's pairs, in `METRICS` order (fp64, detached, on the device: no sync)."""
        chosen, rejected = (r.detach().double() for r in rewards)
        values = [
            chosen.sum(),
            rejected.sum(),
            (chosen > rejected).double().sum(),
            (chosen - rejected).sum(),
            shown[0].detach().double().sum(),
            shown[1].detach().double().sum(),
        ]
        return torch.stack(values)


def _times(factor: float, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return factor * pair[0], factor * pair[1]


def means_of(names: tuple[str, ...], sums: list[float], pairs: int, prefix: str = "") -> dict[str, Any]:
    """The metrics row's fields: each per-pair sum over the global batch's pairs."""
    return {prefix + name: value / max(pairs, 1) for name, value in zip(names, sums, strict=True)}
