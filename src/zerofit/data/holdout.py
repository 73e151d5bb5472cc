"""A held-out evaluation split (`data.eval_split: 0.02`): a seeded choice of records, the same on every rank
and for every batch split.

Records, not examples, are held out: the examples of one long text document (cut into several) all land on
the same side, so evaluation never scores text the model trained on. Preference pairs (one per record) are
held out the same way.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, TypeVar

from zerofit.core.errors import DataError
from zerofit.data.sft import TokenizedData

__all__ = ["eval_source", "hold_out"]

Unit = TypeVar("Unit")  # an `Example` (SFT) or a `PreferencePair`


def eval_source(data: Any) -> tuple[str, str, str] | None:
    """Where the evaluation data of the `data` section is read from as its own source: (path, split, the key
    that names it) for `data.eval_path` (its split `data.eval_split` when that is a name, else `train`) or a
    named `data.eval_split` of `data.path`; None when there is none or it is a fraction held out of
    `data.path` (`hold_out`)."""
    if data.eval_path is not None:
        return (
            data.eval_path,
            data.eval_split if isinstance(data.eval_split, str) else "train",
            "data.eval_path",
        )
    if isinstance(data.eval_split, str):
        return data.path, data.eval_split, "data.path"
    return None


def hold_out(
    data: TokenizedData[Unit], fraction: float, seed: int
) -> tuple[TokenizedData[Unit], TokenizedData[Unit]]:
    """(train, eval): `fraction` of `data`'s records (at least one, rounded) for evaluation, the rest to train.

    The training side keeps the source's counts of truncated and dropped records (the plan reports them for
    the source); the evaluation side counts only its records and examples.
    """
    records = sorted(set(data.records))
    n_eval = max(1, round(fraction * len(records)))
    if n_eval >= len(records):
        raise DataError(
            f"data.eval_split = {fraction} of {len(records)} records leaves none to train on; lower "
            "data.eval_split or add data."
        )
    # A string seed is hashed with SHA-512 by `random.Random`: the same choice in every process.
    chosen = set(random.Random(f"zerofit-eval-split:{seed}").sample(records, n_eval))
    parts: dict[bool, TokenizedData[Unit]] = {}
    for held in (False, True):
        keep = [i for i, r in enumerate(data.records) if (r in chosen) == held]
        stats = dataclasses.replace(data.stats, n_examples=len(keep))
        if held:
            stats = dataclasses.replace(
                stats, n_lines=n_eval, n_truncated=0, n_dropped=0, n_split=0, n_identical=0, n_prompt_cut=0
            )
        parts[held] = TokenizedData([data.examples[i] for i in keep], stats, [data.records[i] for i in keep])
    return parts[False], parts[True]
