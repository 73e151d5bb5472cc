"""The data files zerofit reads, by suffix: the one list, for the config check and the data readers.

`zerofit.config` uses the suffixes to tell a local data-file name from a hub dataset id before anything
is read; `zerofit.data.records` opens each suffix with its kind's reader. A suffix added here is accepted
by both; a new kind needs its reader there too.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["DATA_FILE_KINDS", "DATA_FILE_SUFFIXES", "DataFileKind"]

DataFileKind = Literal["jsonl", "json", "parquet", "csv"]

# Suffix (lower case) -> the kind of reader that opens it.
DATA_FILE_KINDS: dict[str, DataFileKind] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
}
DATA_FILE_SUFFIXES = tuple(DATA_FILE_KINDS)
