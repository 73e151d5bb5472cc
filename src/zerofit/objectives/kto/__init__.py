"""KTO on unpaired feedback (`train.objective: kto`, the `kto` section): {prompt, completion, label} records.

A unit is one example (its mismatched KL row rides along, no-grad); the data is unpaired (data.format
unpaired or auto), packed under `batch.tokens_per_micro_batch` as SFT's examples are; the reference is the base with the LoRA adapters off, so LoRA is needed.
Each micro-step runs three no-grad forwards before the policy's: the reference, and the KL reference
point's mismatched sequences through the policy and the reference. The loss is
`zerofit.objectives.kto.loss.KTOObjective`; its evaluation `zerofit.loop.unpaired`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerofit.objectives.rules import refuse_reference
from zerofit.objectives.spec import UNPAIRED, ObjectiveSpec

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.protocol import Objective

__all__ = ["KTO"]


class KTOSpec(ObjectiveSpec):
    """KTO (module docstring)."""

    name = "kto"
    unit = UNPAIRED

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """Unpaired records (packed or not), LoRA adapters to switch off; no preference reference."""
        fmt = cfg.data.format
        if fmt not in ("auto", "unpaired"):
            problems.append(
                f"train.objective = 'kto' learns from unpaired {{prompt, completion, label}} records (TRL's "
                f"layout), and data.format = {fmt!r} names another format; set data.format=auto (or unpaired) "
                "with data.path at such records"
            )
        if not cfg.lora.enabled:
            problems.append(
                "train.objective = 'kto' compares the policy with a reference model, which zerofit takes as the "
                "base with the LoRA adapters switched off (no second copy), and lora.enabled = false leaves no "
                "adapters: KTO's mismatched-completion reference point changes with every global batch, so it "
                "cannot be precomputed as DPO's reference is. Set lora.enabled=true (or train.objective=dpo on "
                "preference pairs for full fine-tuning with a precomputed reference)"
            )
        refuse_reference(cfg, problems)

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """`KTOObjective` with the `kto` section's knobs."""
        from zerofit.objectives.kto.loss import KTOObjective, KTOSettings

        k = cfg.kto
        return KTOObjective(KTOSettings(k.beta, k.desirable_weight, k.undesirable_weight))

    def describe(self, cfg: ZerofitConfig, reference: str) -> str | None:
        """The knobs, the normalizer, the reference point and the reference."""
        k = cfg.kto
        return (
            f"kto (beta {k.beta:g}, desirable weight {k.desirable_weight:g}, undesirable weight "
            f"{k.undesirable_weight:g}), loss per example over the global batch's examples, KL reference point "
            "over the global batch's mismatched completions; reference: the base with the LoRA adapters off"
        )

    def planned_reference(self, cfg: ZerofitConfig) -> str:
        """Always the base with the adapters off."""
        return "adapters_off"

    def no_grad_forwards(self, reference: str) -> int:
        """The reference, and the KL pass through the policy and the reference."""
        return 3

    def planned_line(self, memory: dict[str, Any]) -> str | None:
        rows = memory["sequences_per_micro_batch"]
        return (
            f"Planned for train.objective kto: {rows} examples per micro-batch, each micro-step three no-grad "
            "forwards of them (reference, KL policy, KL reference) before its training forward"
        )

    def planner_notes(self, micro_batch_size: int, rows: int, seq_len: int, reference: str) -> list[str]:
        return [
            f"train.objective kto: a micro-batch of {micro_batch_size} examples is one forward of as many "
            "sequences, after three no-grad forwards of them (the reference with the adapters off, and the KL "
            "reference point's mismatched sequences through the policy and the reference), all in the step time"
        ]

    def synthetic_batch(
        self, micro: int, seq: int, vocab: int, pad_id: int, cfg: ZerofitConfig
    ) -> dict[str, Any]:
        """`collate_unpaired`'s layout: the rows, their KL rows as long, the labels and `examples`."""
        import torch

        from zerofit.objectives.synthetic import token_rows

        batch = token_rows(micro, seq, vocab, pad_id)
        kl = {f"kl_{k}": v.clone() for k, v in batch.items()}
        return {**batch, **kl, "desirable": torch.arange(micro) % 2 == 0, "examples": torch.tensor(micro)}


KTO = KTOSpec()
