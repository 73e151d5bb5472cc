"""The pairwise preference losses (DPO, SimPO, ORPO, CPO) on `collate_pairs` micro-batches: one forward
of the micro-batch's 2m rows (chosen, then rejected), per-pair losses from their response log-probs.

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

Each is a pair loss (`PairLoss`: the pair's log-probs -> per-pair losses, rewards and the log-probs shown)
and the settings of `PreferenceObjective` (`PreferenceSettings`: the pair loss, the reference, the NLL on
the chosen sequences and its weight); the slice's spec (`zerofit.objectives.pairwise`) builds them from the
`preference` section.

A preference micro-batch is `zerofit.data.pairs.collate_pairs`' 2m rows (chosen, then rejected) and one
forward; per-row log-probs are sums of `forward_token_losses` (the chunked loss, or inside lm_head for
`fused_linear`: one fp32 number per token, never full fp32 logits). The reference is, per
`preference.reference`: `adapters_off` the same model with its LoRA adapters disabled (peft's
`disable_adapter`, no gradients, before the policy forward, on every micro-batch, the dummy row of an
empty one included so every rank runs the same forwards); `precomputed` the batch's `reference_logps`
(`zerofit.loop.reference`); `none` for SimPO and ORPO.

A packed micro-batch (`batch.tokens_per_micro_batch`: `zerofit.data.pairs.pair_micro_batches`) is the same
2m sequences as segments of fewer rows, numbered as the padded rows (`sequence_ids`): the per-sequence sums
are gathered by number (`zerofit.objectives.logps.sequence_logps`), so every loss, count and metric is the
padded layout's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerofit.objectives.logps import adapters_disabled, sequence_logps, sequence_sums
from zerofit.objectives.protocol import Batch, UnitMeans
from zerofit.token_loss.fused import forward_token_losses
from zerofit.token_loss.sums import IGNORE_INDEX, count_label_tokens, shifted_targets

__all__ = [
    "METRICS",
    "PairLogps",
    "PairLoss",
    "PairResult",
    "PreferenceObjective",
    "PreferenceSettings",
    "dpo_losses",
    "dpo_pair",
    "margin_losses",
    "nll_labels",
    "orpo_losses",
    "orpo_pair",
    "simpo_losses",
    "simpo_pair",
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

Pair = tuple[torch.Tensor, torch.Tensor]  # (chosen, rejected), one value per pair each


@dataclass(frozen=True)
class PairLogps:
    """A micro-batch's pairs as a pair loss reads them: summed and per-token mean response log-probs of
    the policy, the response lengths, and the reference's summed log-probs (None: no reference)."""

    sums: Pair
    means: Pair
    lengths: Pair
    reference: Pair | None


# A pair loss's answer: per-pair losses, (chosen, rejected) rewards, and the (chosen, rejected) log-probs shown.
PairResult = tuple[torch.Tensor, Pair, Pair]
PairLoss = Callable[[PairLogps], PairResult]


@dataclass(frozen=True)
class PreferenceSettings:
    """How `PreferenceObjective` scores pairs: `pair_loss`, the reference (`adapters_off`, `precomputed`
    or `none`, resolved), and an NLL on the chosen sequences: None, `response` (their response tokens) or
    `sequence` (every real token, prompt included), weighted by `nll_weight`, normalized by the global
    batch's tokens it is over."""

    pair_loss: PairLoss
    reference: str
    nll: str | None = None
    nll_weight: float = 1.0


def _logsig_smoothed(x: torch.Tensor, smoothing: float) -> torch.Tensor:
    """-log sigmoid(x), with conservative label smoothing (the assumed rate of flipped labels)."""
    return -F.logsigmoid(x) * (1 - smoothing) - F.logsigmoid(-x) * smoothing


def dpo_losses(
    policy: Pair, reference: Pair, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per pair DPO loss from (chosen, rejected) log-probs of the policy and the reference (TRL's)."""
    margin = (policy[0] - policy[1]) - (reference[0] - reference[1])
    return margin_losses(margin, beta, loss_type, label_smoothing)


def margin_losses(
    margin: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per pair loss of a log-prob margin (DPO's against a reference, CPO's of the policy alone): sigmoid,
    hinge or ipo, as TRL's."""
    if loss_type == "sigmoid":
        return _logsig_smoothed(beta * margin, label_smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin)
    if loss_type == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    raise ValueError(f"preference.loss_type {loss_type!r}: expected sigmoid, ipo or hinge")


def simpo_losses(mean_logps: Pair, beta: float, gamma: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per pair SimPO loss from mean response log-probs: -logsig(beta (c - r) - gamma), `gamma` the target
    reward margin itself (TRL's `simpo_gamma`; the SimPO authors' gamma_beta_ratio is gamma / beta)."""
    return _logsig_smoothed(beta * (mean_logps[0] - mean_logps[1]) - gamma, label_smoothing)


def orpo_losses(mean_logps: Pair, lam: float) -> torch.Tensor:
    """Per pair ORPO odds-ratio term, lambda x -logsig(log odds(chosen) - log odds(rejected)).

    log odds(p) = log p - log(1 - p) of the mean response log-prob; `log1p(-exp(.))` is exact near 0.
    """
    chosen, rejected = mean_logps
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return -lam * F.logsigmoid(log_odds)


def _times(factor: float, pair: Pair) -> Pair:
    return factor * pair[0], factor * pair[1]


def dpo_pair(p: PairLogps, beta: float, loss_type: str, label_smoothing: float) -> PairResult:
    """DPO's pair loss: the policy's margin over the reference's (IPO on per-token means, as TRL's)."""
    if p.reference is None:
        raise ValueError("DPO's loss is a log-prob ratio against a reference, and this batch has none")
    policy, ref = p.sums, p.reference
    rewards = _times(beta, (policy[0] - ref[0], policy[1] - ref[1]))
    if loss_type == "ipo":  # TRL's IPO: per-token mean log-probs
        policy = p.means
        ref = (ref[0] / p.lengths[0].clamp(min=1), ref[1] / p.lengths[1].clamp(min=1))
    return dpo_losses(policy, ref, beta, loss_type, label_smoothing), rewards, p.sums


def simpo_pair(p: PairLogps, beta: float, gamma: float, label_smoothing: float) -> PairResult:
    """SimPO's pair loss on the mean log-probs, with the target margin `gamma`; no reference."""
    return simpo_losses(p.means, beta, gamma, label_smoothing), _times(beta, p.means), p.means


def orpo_pair(p: PairLogps, lam: float) -> PairResult:
    """ORPO's odds-ratio term on the mean log-probs (its NLL is the objective's `nll` term)."""
    return orpo_losses(p.means, lam), _times(lam, p.means), p.means


def nll_labels(batch: Batch, sequence: bool) -> torch.Tensor:
    """The labels an NLL on the chosen sequences (the first `pairs`) is over: their response labels, or with
    `sequence` every real token of the chosen sequence (prompt included, padding never), as TRL's ORPO and
    the ORPO authors' default. Padded: the chosen rows; packed: every row, IGNORE_INDEX outside the chosen
    segments (and on each segment's first token, which nothing before it in the row predicts)."""
    m, ids = int(batch["pairs"]), batch.get("sequence_ids")
    if ids is not None:
        chosen = (ids >= 0) & (ids < m)
        if sequence:
            chosen &= batch["position_ids"] > 0
        source = batch["input_ids"] if sequence else batch["labels"]
        return torch.where(chosen, source, torch.full_like(source, IGNORE_INDEX))
    if not sequence:
        return batch["labels"][:m]
    real = batch["attention_mask"][:m] == 1
    return torch.where(real, batch["input_ids"][:m], torch.full_like(batch["input_ids"][:m], IGNORE_INDEX))


class PreferenceObjective(UnitMeans):
    """A pair loss (DPO, SimPO, ORPO, CPO) on `collate_pairs` micro-batches (module docstring)."""

    metrics: tuple[str, ...] = METRICS

    def __init__(self, settings: PreferenceSettings) -> None:
        self.s = settings

    def counts(self, micro_batches: list[Batch]) -> list[int]:
        """Pairs of this rank's micro-batches (with an NLL: first the chosen tokens it is over)."""
        pairs = sum(int(b["pairs"]) for b in micro_batches)
        if self.s.nll is None:
            return [pairs]
        sequence = self.s.nll == "sequence"
        chosen = sum(count_label_tokens(nll_labels(b, sequence)) for b in micro_batches)
        return [chosen, pairs]

    def terms(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], batch: Batch, impl: str
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One forward of the micro-batch's 2m rows (after the reference's, for adapters_off): the loss
        sums (one per count) and the detached per-pair metric sums (`METRICS`, fp64)."""
        labels, m = batch["labels"], int(batch["pairs"])
        reference = self._reference(model, inputs, batch, impl)
        sequence_nll = self.s.nll == "sequence" and m > 0
        if sequence_nll:  # one forward scores the chosen rows' prompts too; the responses are picked out
            token_nll = forward_token_losses(model, inputs, self._sequence_forward_labels(batch), impl)
            chosen_nll = sequence_sums(token_nll, batch.get("sequence_ids"))[:m].sum()
            response = shifted_targets(labels).reshape(labels.shape) != IGNORE_INDEX
            token_nll = token_nll.where(response.to(token_nll.device), 0.0)
        else:
            token_nll = forward_token_losses(model, inputs, labels, impl)
        logps, lengths = sequence_logps(token_nll, labels, batch.get("sequence_ids"))
        if m == 0:  # an empty micro-batch's dummy row: zero loss that still carries the graph
            zero = logps.sum() * 0.0
            return [zero] * len(self.counts([batch])), zero.new_zeros(len(METRICS), dtype=torch.float64)
        means = logps / lengths.clamp(min=1)
        pair = PairLogps(
            sums=(logps[:m], logps[m:]),
            means=(means[:m], means[m:]),
            lengths=(lengths[:m], lengths[m:]),
            reference=(reference[:m], reference[m:]) if reference is not None else None,
        )
        losses, rewards, shown = self.s.pair_loss(pair)
        terms = [losses.sum()]
        if self.s.nll is not None:  # the chosen NLL (over `counts`' chosen tokens), then the pair term
            nll = chosen_nll if sequence_nll else -logps[:m].sum()
            terms = [nll * self.s.nll_weight, terms[0]]
        return terms, self._metric_sums(rewards, shown)

    def _sequence_forward_labels(self, batch: Batch) -> torch.Tensor:
        """The labels of the one forward with a whole-sequence NLL: the chosen sequences' `nll_labels`, the
        rejected ones' own."""
        m, chosen = int(batch["pairs"]), nll_labels(batch, sequence=True)
        if "sequence_ids" in batch:  # packed: the chosen segments' tokens, the labels elsewhere
            return torch.where(chosen != IGNORE_INDEX, chosen, batch["labels"])
        return torch.cat([chosen, batch["labels"][m:]])

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
        labels = batch["labels"]
        with torch.no_grad(), adapters_disabled(model):
            token_nll = forward_token_losses(model, inputs, labels, impl)
        return sequence_logps(token_nll, labels, batch.get("sequence_ids"))[0]

    @staticmethod
    def _metric_sums(rewards: Pair, shown: Pair) -> torch.Tensor:
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
