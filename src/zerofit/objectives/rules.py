"""Config rules several slices share: the data format an objective reads and the preference reference of
an objective that has none. Each slice's `check` calls the ones that apply to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig

__all__ = ["refuse_pairs_format", "refuse_reference", "refuse_unpaired_format"]


def refuse_unpaired_format(cfg: ZerofitConfig, problems: list[str]) -> None:
    """KTO's unpaired feedback is data only KTO learns from."""
    if cfg.data.format == "unpaired":
        problems.append(
            f"data.format = 'unpaired' is KTO's {{prompt, completion, label}} feedback, and train.objective = "
            f"{cfg.train.objective!r} does not learn from it; set train.objective=kto, or data.format to the "
            "data's format"
        )


def refuse_pairs_format(cfg: ZerofitConfig, problems: list[str]) -> None:
    """A pairwise objective reads preference pairs: data.format preference or auto."""
    fmt = cfg.data.format
    if fmt not in ("preference", "auto"):
        problems.append(
            f"train.objective = {cfg.train.objective!r} learns from preference pairs, and data.format = {fmt!r} "
            "has one response per record; set data.format=preference (or auto) with data.path at {prompt, "
            "chosen, rejected} records, or train.objective=sft"
        )


def refuse_reference(cfg: ZerofitConfig, problems: list[str]) -> None:
    """`preference.reference` set for an objective without a preference reference model."""
    reference = cfg.preference.reference
    if reference not in ("auto", "none"):
        problems.append(
            f"preference.reference = {reference!r} with train.objective = {cfg.train.objective!r}, which uses no "
            "reference model (only DPO does), so it would be ignored; set preference.reference=auto (or "
            "none), or train.objective=dpo"
        )
