"""A cache checked against its source before use: a seeded sample made again and compared.

A cache's own digest (the SHA-256 in a tokenization entry's meta.json, in a reference table's metadata)
proves only that nothing changed it by accident: whoever can write the entry can write a matching digest,
with zerofit's own function. So a hit is also compared with what the source makes now, on a sample cheap
next to building the entry:

- `sample_indices`: which records (rows) to make again: all of them when there are at most
  `SAMPLE_SIZE`, else the first, the last and others chosen by a random generator seeded with
  `SAMPLE_SEED`, `SAMPLE_SIZE` in all. The same data gives the same sample on every rank and every run.
- `checked`: a tokenization cache hit (`zerofit.data.cache`), as the loader's units (examples, pairs, ...),
  against the same records read from the source (`RecordSource.records_at`) and tokenized again, compared
  unit by unit and field by field (`difference`); a mismatch removes the entry, and the loader tokenizes
  the data again and writes it anew.
- `mismatch_note`: the one line either check prints when its cache does not match its source
  (`zerofit.loop.reference` checks the precomputed DPO reference the same way, with the model).

What it catches: an entry rewritten as a whole (ids remapped, a column of log-probs shifted), in a shared
team cache, a cache folder copied from elsewhere or by hand, with or without its digest fixed up. What it
does not: an edit confined to records outside the sample (8 of 10,000 records are checked, so a change to a
few is found with a probability of about 8 in 10,000 per changed record), and a source that is itself wrong.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import DataError
from zerofit.data.cache import discard_entry, entry_dir

__all__ = [
    "SAMPLE_SEED",
    "SAMPLE_SIZE",
    "checked",
    "difference",
    "mismatch_note",
    "sample_indices",
]

SAMPLE_SIZE = 8  # records (reference rows) made again per check: cheap next to a build, the same every run
SAMPLE_SEED = 0  # the sample's random generator: the same rows on every rank and every run

# Re-tokenizes the records numbered in the list; returns the units they make and each unit's record.
Retokenize = Callable[[list[int]], tuple[Sequence[Any], Sequence[int]]]


def sample_indices(indices: Sequence[int]) -> list[int]:
    """The ones of `indices` (distinct, ascending) a check makes again, ascending: all of them when there
    are at most `SAMPLE_SIZE`, else the first, the last and `SAMPLE_SIZE` - 2 of the others drawn by a
    `random.Random(SAMPLE_SEED)`."""
    if len(indices) <= SAMPLE_SIZE:
        return list(indices)
    inner = random.Random(SAMPLE_SEED).sample(range(1, len(indices) - 1), SAMPLE_SIZE - 2)
    return [indices[i] for i in sorted([0, *inner, len(indices) - 1])]


def difference(cached: Any, fresh: Any, name: str = "") -> str | None:
    """Where `cached` and `fresh` differ (a field path such as `chosen.input_ids`, or the value's name), or
    None when they are equal: dataclasses field by field, lists and dicts item by item, tensors exactly."""
    where = name or "the value"
    if type(cached) is not type(fresh):
        return where
    if isinstance(cached, torch.Tensor):
        return None if cached.shape == fresh.shape and torch.equal(cached, fresh) else where
    parts: list[tuple[Any, Any, str]]
    if dataclasses.is_dataclass(cached):
        parts = [
            (getattr(cached, f.name), getattr(fresh, f.name), _join(name, f.name))
            for f in dataclasses.fields(cached)
        ]
    elif isinstance(cached, dict):
        if cached.keys() != fresh.keys():
            return where
        parts = [(cached[k], fresh[k], _join(name, str(k))) for k in cached]
    elif isinstance(cached, (list, tuple)):
        if len(cached) != len(fresh):
            return where
        parts = [(a, b, name) for a, b in zip(cached, fresh, strict=True)]
    else:
        return None if cached == fresh else where
    return next((found for a, b, part in parts if (found := difference(a, b, part)) is not None), None)


def _join(name: str, field: str) -> str:
    return f"{name}.{field}" if name else field


def _units_of(units: Sequence[Any], records: Sequence[int], record: int) -> list[Any]:
    """The units of `record` (`records` ascending, one per unit)."""
    return list(units[bisect.bisect_left(records, record) : bisect.bisect_right(records, record)])


def source_difference(
    units: Sequence[Any], records: Sequence[int], retokenize: Retokenize, source: str
) -> str | None:
    """What differs between the cached `units` (with their `records`) and the sampled records of `source`
    (named so) tokenized again by `retokenize`, or None when the sample matches."""
    # Record 0 too, first: `data.format: auto` is detected from it, as when the entry was built.
    picked = sorted({0, *sample_indices(sorted(set(records)))})
    try:
        fresh, fresh_records = retokenize(picked)
    except DataError as exc:
        return f"{source}'s sampled records cannot be tokenized now: {str(exc)[:200]}"
    for record in picked:
        have, want = _units_of(units, records, record), _units_of(fresh, fresh_records, record)
        if len(have) != len(want):
            return f"record {record} of {source} now makes {len(want)} examples where the entry holds {len(have)}"
        for k, (a, b) in enumerate(zip(have, want, strict=True)):
            found = difference(a, b)
            if found is not None:
                return f"record {record} of {source}, tokenized again, differs in example {k}'s {found}"
    return None


def mismatch_note(path: Path, why: str) -> None:
    """The one line that says the cache at `path` does not match its source and is being rebuilt."""
    print(f"zerofit: {path} does not match its source ({why}); rebuilding it", file=sys.stderr, flush=True)


def checked(
    key: str, units: Sequence[Any], records: Sequence[int], retokenize: Retokenize, source: str
) -> bool:
    """Whether the tokenization cache entry `key` (read as `units`, one `records` number each) matches its
    `source` on the sampled records; an entry that does not is removed, with a one-line note (the caller
    then tokenizes the data and writes the entry anew)."""
    why = source_difference(units, records, retokenize, source)
    if why is None:
        return True
    mismatch_note(entry_dir(key), why)
    discard_entry(key)
    return False
