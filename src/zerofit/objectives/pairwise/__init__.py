"""Pairwise preference tuning on {prompt, chosen, rejected} pairs: DPO, SimPO and ORPO (`train.objective`
dpo / simpo / orpo), one `PairwiseSpec` each over the `preference` section.

A unit is a pair (two rows in one forward, or two segments of packed rows under
`batch.tokens_per_micro_batch`); the data is preference pairs (data.format preference or auto); the loss is `zerofit.objectives.pairwise.loss.PreferenceObjective` with the member's pair loss.
Only DPO has a reference model (`preference.reference`: the base with the adapters off under LoRA, else
log-probs precomputed once before training, `zerofit.loop.reference`); the others resolve it to none.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from zerofit.objectives.rules import (
    refuse_pairs_format,
    refuse_reference,
    refuse_unpaired_format,
)
from zerofit.objectives.spec import PAIR, ObjectiveSpec

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.pairwise.loss import PairLoss
    from zerofit.objectives.protocol import Objective

__all__ = ["DPO", "ORPO", "SIMPO", "PairwiseSpec"]

# The reference as `zerofit plan` says it plans it (`{rows}`: the micro-batch's rows).
_REFERENCE_PLANNED = {
    "adapters_off": "adapters_off, a no-grad forward of the same {rows} rows through the base per micro-step "
    "(counted in memory and step time)",
    "precomputed": "precomputed, one no-grad pass over every pair before training (nothing per step)",
    "none": "none",
}


class PairwiseSpec(ObjectiveSpec):
    """A pairwise preference objective: the rules, plan lines and probe batch its members share. A member
    says its pair loss (`pair_loss`), its knobs as the plan prints them (`knobs`) and, where it has one, its
    NLL on the chosen sequences (`nll`, `nll_weight`)."""

    unit = PAIR
    vision = True  # pairs with images (`zerofit.data.vision_pairs`)

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """Preference pairs (packed or not: `batch.tokens_per_micro_batch` packs them, both sequences of a
        pair in one micro-batch); a preference reference only where the member has one."""
        refuse_unpaired_format(cfg, problems)
        refuse_pairs_format(cfg, problems)
        self.check_reference(cfg, problems)

    def check_reference(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """A member without a reference model refuses `preference.reference` set to one."""
        refuse_reference(cfg, problems)

    def pair_loss(self, cfg: ZerofitConfig) -> PairLoss:
        """The member's per-pair loss with the config's knobs."""
        raise NotImplementedError

    def knobs(self, cfg: ZerofitConfig) -> str:
        """The member's knobs as the plan's objective line shows them."""
        raise NotImplementedError

    def nll(self, cfg: ZerofitConfig) -> tuple[str | None, float]:
        """The NLL on the chosen sequences (None, `response` or `sequence`) and its weight."""
        return None, 1.0

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """`PreferenceObjective` with this member's pair loss, the resolved reference and its NLL."""
        from zerofit.objectives.pairwise.loss import PreferenceObjective, PreferenceSettings

        nll, weight = self.nll(cfg)
        settings = PreferenceSettings(self.pair_loss(cfg), cfg.preference.reference, nll, weight)
        return PreferenceObjective(settings)

    def precomputes_reference(self, cfg: ZerofitConfig) -> bool:
        """The reference's log-probs computed once before training."""
        return cfg.preference.reference == "precomputed"

    def describe(self, cfg: ZerofitConfig, reference: str) -> str | None:
        """`dpo (sigmoid, beta 0.1, ...), loss per pair over the global batch's pairs; reference: ...`."""
        shown = {
            "adapters_off": "the base with the LoRA adapters off (no second copy), before each policy forward",
            "precomputed": reference or "precomputed",
            "none": "none",
        }[cfg.preference.reference]
        return f"{self.name} ({self.knobs(cfg)}), loss per pair over the global batch's pairs; reference: {shown}"

    def planned_reference(self, cfg: ZerofitConfig) -> str:
        """The resolved `preference.reference`."""
        return cfg.preference.reference

    def planned_line(self, memory: dict[str, Any]) -> str | None:
        """Pairs per micro-batch, the rows of its forward, and the reference as planned."""
        rows, micro = memory["sequences_per_micro_batch"], memory["micro_batch_size"]
        reference = _REFERENCE_PLANNED.get(memory["reference"], memory["reference"]).format(rows=rows)
        laid_out = (
            f"{micro} pairs per micro-batch = {rows} sequences per forward (chosen and rejected)"
            if rows == 2 * micro
            else f"{rows} packed rows per micro-batch (chosen and rejected sequences as their segments)"
        )
        return f"Planned for train.objective {self.name}: {laid_out}; reference {reference}"

    def planner_notes(self, micro_batch_size: int, rows: int, seq_len: int, reference: str) -> list[str]:
        """The pairs' rows in every activation, and what the reference costs per step."""
        laid_out = (
            f"a micro-batch of {micro_batch_size} pairs is one forward of {rows} sequences (chosen and rejected)"
            if rows == 2 * micro_batch_size
            else f"a micro-batch is one forward of {rows} packed rows (chosen and rejected sequences as segments)"
        )
        notes = [
            f"train.objective {self.name}: {laid_out}, every activation and the loss counted for {rows} x "
            f"{seq_len} tokens"
        ]
        if reference == "adapters_off":
            notes.append(
                f"reference adapters_off: each micro-step first runs the {rows} rows through the base with the "
                "adapters off under no_grad (nothing saved: one layer's working set, then the log-probs' logits), "
                "and its forward is in the step time"
            )
        elif reference == "precomputed":
            notes.append(
                "reference precomputed: its log-probs are computed once before training (one no-grad pass over "
                "every pair, less memory than a training step, cached with the data) and cost nothing per step"
            )
        return notes

    def synthetic_batch(
        self, micro: int, seq: int, vocab: int, pad_id: int, cfg: ZerofitConfig
    ) -> dict[str, Any]:
        """`collate_pairs`' layout: 2 x micro rows (chosen, then rejected) and `pairs`; zero reference
        log-probs when they are precomputed (the loss reads them from the batch)."""
        import torch

        from zerofit.objectives.synthetic import token_rows

        batch = token_rows(2 * micro, seq, vocab, pad_id)
        batch["pairs"] = torch.tensor(micro)
        if cfg.preference.reference == "precomputed":
            batch["reference_logps"] = torch.zeros(2 * micro, dtype=torch.float64)
        return batch


class DPOSpec(PairwiseSpec):
    """DPO (and IPO, hinge via `preference.loss_type`): the policy's log-prob margin over a reference's."""

    name = "dpo"

    def check_reference(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """DPO needs a reference; adapters off only with adapters to switch off."""
        reference = cfg.preference.reference
        if reference == "none":
            problems.append(
                "preference.reference = 'none' with train.objective = 'dpo': DPO's loss is the policy's log-prob "
                "ratio against a reference model's; set preference.reference=auto (adapters_off under LoRA, "
                "else precomputed), or train.objective=simpo / orpo, which need none"
            )
        if reference == "adapters_off" and not cfg.lora.enabled:
            problems.append(
                "preference.reference = 'adapters_off' uses the base model with the LoRA adapters switched off "
                "as the reference, and lora.enabled = false leaves no adapters to switch off; set "
                "preference.reference=precomputed (log-probs computed once before training) or auto, or "
                "lora.enabled=true"
            )

    def fill(self, cfg: ZerofitConfig) -> None:
        """`preference.reference: auto`: the base with the adapters off under LoRA (no second copy), else
        log-probs precomputed before training."""
        if cfg.preference.reference == "auto":
            cfg.preference.reference = "adapters_off" if cfg.lora.enabled else "precomputed"

    def pair_loss(self, cfg: ZerofitConfig) -> PairLoss:
        from zerofit.objectives.pairwise.loss import dpo_pair

        p = cfg.preference
        return functools.partial(
            dpo_pair, beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing
        )

    def knobs(self, cfg: ZerofitConfig) -> str:
        p = cfg.preference
        return f"{p.loss_type}, beta {p.beta:g}, label smoothing {p.label_smoothing:g}"


class SimPOSpec(PairwiseSpec):
    """SimPO: the mean log-prob margin against a target margin gamma; no reference."""

    name = "simpo"

    def pair_loss(self, cfg: ZerofitConfig) -> PairLoss:
        from zerofit.objectives.pairwise.loss import simpo_pair

        p = cfg.preference
        return functools.partial(
            simpo_pair, beta=p.beta, gamma=p.simpo_margin(), label_smoothing=p.label_smoothing
        )

    def knobs(self, cfg: ZerofitConfig) -> str:
        p = cfg.preference
        return f"beta {p.beta:g}, margin gamma {p.simpo_margin():g} (= {p.simpo_margin() / p.beta:g} x beta), mean log-probs"


class ORPOSpec(PairwiseSpec):
    """ORPO: the chosen sequences' NLL plus lambda x the odds-ratio term; no reference."""

    name = "orpo"

    def pair_loss(self, cfg: ZerofitConfig) -> PairLoss:
        from zerofit.objectives.pairwise.loss import orpo_pair

        return functools.partial(orpo_pair, lam=cfg.preference.orpo_lambda)

    def nll(self, cfg: ZerofitConfig) -> tuple[str | None, float]:
        """Over the chosen sequence (prompt included) with `orpo_prompt_loss`, else its response."""
        return ("sequence" if cfg.preference.orpo_prompt_loss else "response"), 1.0

    def knobs(self, cfg: ZerofitConfig) -> str:
        p = cfg.preference
        over = "prompt and response tokens" if p.orpo_prompt_loss else "response tokens"
        return f"lambda {p.orpo_lambda:g}, NLL over the global batch's chosen {over}"


DPO = DPOSpec()
SIMPO = SimPOSpec()
ORPO = ORPOSpec()
