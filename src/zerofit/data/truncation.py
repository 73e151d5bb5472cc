"""Examples cut to `data.max_seq_len`: counted always, said when they are many, refused on request.

A cut example loses its end — for prompt/response data, the end of the answer the model should learn — so a
run whose data is largely cut trains on something else than the data. Loading counts the cut examples
(`DataStats.n_truncated`) and measures the length that would keep `WHOLE_SHARE` of them whole
(`DataStats.whole_len`, `length_keeping_whole`). When more than `TRUNCATION_SHARE` are cut, the rule
`data.truncation` (`TRUNCATION_RULES`) decides: `warn` (default) says so once, in the run's plan, with
that length; `error` refuses the data with the same numbers (`check_truncation`, on rank 0 before training);
`allow` leaves the count in the plan's data line only.
"""

from __future__ import annotations

import math
from typing import Protocol, TypeVar, get_args

from zerofit.config.schema import Truncation
from zerofit.core.errors import DataError

__all__ = [
    "LENGTH_PROBE",
    "TRUNCATION_RULES",
    "TRUNCATION_SHARE",
    "WHOLE_SHARE",
    "check_truncation",
    "length_keeping_whole",
    "truncation_note",
]

TRUNCATION_RULES: tuple[str, ...] = get_args(Truncation)  # data.truncation
TRUNCATION_SHARE = 0.05  # more than this share of the examples cut: the rule acts (warn, or refuse)
WHOLE_SHARE = 0.95  # the length suggested keeps this share of the examples whole
LENGTH_PROBE = 16  # a cut example's length is measured up to this many times data.max_seq_len


class CutCounts(Protocol):
    """What the rule reads of `zerofit.data.DataStats` (this module sits below the loaders that make it)."""

    n_examples: int
    n_truncated: int
    whole_len: int
    format: str
    source: str


class _Loaded(Protocol):
    """A loader's result (`zerofit.data.TokenizedData`): what it read and its counts."""

    @property
    def stats(self) -> CutCounts: ...


Loaded = TypeVar("Loaded", bound=_Loaded)


def length_keeping_whole(lengths: list[int], share: float = WHOLE_SHARE) -> int:
    """The smallest length at least `share` of `lengths` fit in (0 for no lengths)."""
    if not lengths:
        return 0
    ordered = sorted(lengths)
    return ordered[max(math.ceil(share * len(ordered)) - 1, 0)]


def truncation_note(stats: CutCounts, max_seq_len: int) -> str | None:
    """`100 of 300 examples (33%) are cut to data.max_seq_len = 64 tokens; data.max_seq_len=190 keeps 95%
    of them whole`, or None when at most `TRUNCATION_SHARE` are cut."""
    if stats.n_examples == 0 or stats.n_truncated <= TRUNCATION_SHARE * stats.n_examples:
        return None
    unit = "pairs" if stats.format == "preference" else "examples"
    share = stats.n_truncated / stats.n_examples
    text = (
        f"{stats.n_truncated:,} of {stats.n_examples:,} {unit} ({share:.0%}) are cut to data.max_seq_len = "
        f"{max_seq_len} tokens, above the {TRUNCATION_SHARE:.0%} zerofit lets pass unsaid"
    )
    whole = f"{WHOLE_SHARE:.0%} of them whole"
    if stats.whole_len > LENGTH_PROBE * max_seq_len:
        return f"{text}; even data.max_seq_len={LENGTH_PROBE * max_seq_len} would not keep {whole}"
    if stats.whole_len > max_seq_len:
        return f"{text}; data.max_seq_len={stats.whole_len} keeps {whole}"
    return f"{text}; a longer data.max_seq_len keeps more of them whole"


def check_truncation(data: Loaded, max_seq_len: int, rule: str) -> Loaded:
    """`data` as it is, unless `data.truncation = 'error'` and more than `TRUNCATION_SHARE` of it is cut:
    then one `DataError` with the numbers and the fixes."""
    if rule not in TRUNCATION_RULES:
        raise ValueError(f"truncation must be one of {TRUNCATION_RULES}, not {rule!r}")
    note = truncation_note(data.stats, max_seq_len)
    if rule != "error" or note is None:
        return data
    raise DataError(
        f"{data.stats.source}: {note}. data.truncation = 'error' refuses such data: the cut examples lose "
        "their ends (for prompt/response data, the end of the answer). Raise data.max_seq_len, shorten or "
        "remove the long records, or set data.truncation=warn to train on them cut (said in the run's plan)."
    )
