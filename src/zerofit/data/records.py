"""Where training records come from: one streaming reader per kind of source, all yielding
`(where, record)` pairs, `where` naming the file and line (or row) for error messages.

    local file      .jsonl / .ndjson (one JSON object per line; any other suffix is read as JSONL too),
                    .json (an array of objects, or JSON lines), .parquet, .csv / .tsv
    local folder    written by `datasets.Dataset.save_to_disk` (or `DatasetDict.save_to_disk`: a split)
    anything else   a hub dataset id (`org/name`) through `datasets.load_dataset`, which caches it; with
                    HF_HUB_OFFLINE=1 it loads from that cache

Files are read a line or a row batch at a time, so a large file never sits in memory as a whole (a JSON
array excepted: it has to be parsed whole). `consumed` / `total` drive the progress bar, in bytes or rows.
Nothing here knows about formats or tokenizers (`formats.py`, `sft.py`).
"""

from __future__ import annotations

import csv
import io
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from zerofit.config.rules.data import looks_like_hub_id
from zerofit.core.data_files import DATA_FILE_KINDS, DATA_FILE_SUFFIXES, DataFileKind
from zerofit.core.digest import content_sha256, files_sha256
from zerofit.core.errors import DataError
from zerofit.core.progress import Progress, progress

__all__ = ["PROGRESS_EVERY", "RecordSource", "open_source"]

PROGRESS_EVERY = 256  # records between two updates of a tokenizing progress (`RecordSource.tokenizing`)


class RecordSource(ABC):
    """A stream of records (dicts) with where each came from, plus what the cache and the progress need."""

    kind: str  # how the source is described to the user ("JSONL file", "hub dataset", ...)
    unit: str  # "B" (progress in bytes) or "rows"

    def __init__(self, name: str) -> None:
        self.name = name  # as the user wrote it (data.path / data.eval_path)
        self.consumed = 0  # bytes or rows read so far
        self.total = 0  # bytes or rows in all
        self.rows = 0  # records read so far (for a JSONL file: lines, blank ones included)

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """`(where, record)` for every record, in order; bad input raises `DataError` naming `where`."""

    @abstractmethod
    def fingerprint(self) -> str | None:
        """A hash of the content (None: unknown, so the result is not cached)."""

    def describe(self) -> str:
        return f"{self.name} ({self.kind})"

    def records_at(self, wanted: Sequence[int]) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """`(index, where, record)` of the records numbered `wanted` (0-based, ascending), reading no
        further than the last of them, and leaving the progress counters as they were (a cache's sample
        check, `zerofit.data.cache_check`, reads them before any tokenizing)."""
        counters = self.consumed, self.rows
        pending = iter(wanted)
        target = next(pending, None)
        try:
            for index, (where, record) in enumerate(self):
                if target is None:
                    return
                if index == target:
                    yield index, where, record
                    target = next(pending, None)
        finally:
            self.consumed, self.rows = counters

    def tokenizing(self, enabled: bool) -> AbstractContextManager[Progress]:
        """The progress of tokenizing this source (`zerofit.core.progress`), in bytes or rows: the reader
        calls `update(self.consumed)` now and then."""
        return progress(f"tokenizing {self.describe()}", self.total, self.unit, enabled=enabled)


# ---------------------------------------------------------------- local files


class JsonlSource(RecordSource):
    """One JSON object per line; blank lines are skipped (and counted as lines)."""

    kind, unit = "JSONL file", "B"

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path
        self.total = path.stat().st_size

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        with self.path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                self.consumed += len(raw)
                self.rows = lineno
                where = f"{self.path}:{lineno}"
                record = _parse_json_line(raw, where)
                if record is not None:
                    yield where, record

    def records_at(self, wanted: Sequence[int]) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """`RecordSource.records_at`, parsing only the wanted lines (the others are only told blank or not)."""
        pending = iter(wanted)
        target, index = next(pending, None), 0
        with self.path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if target is None:
                    return
                if not raw.decode("utf-8", "replace").strip():
                    continue  # a blank line: no record (`_parse_json_line`)
                if index == target:
                    where = f"{self.path}:{lineno}"
                    yield index, where, _parse_json_line(raw, where) or {}
                    target = next(pending, None)
                index += 1

    def fingerprint(self) -> str:
        return content_sha256(self.path)


def _parse_json_line(raw: bytes, where: str) -> dict[str, Any] | None:
    """One JSONL line as a dict, None for a blank line, `DataError` naming file:line otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start}); save the file as UTF-8."
        ) from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object "
            'like {"prompt": "...", "response": "..."} or {"messages": [...]}.'
        ) from None
    return _as_record(obj, where)


def _as_record(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(
            f"{where}: expected a JSON object (a record with named fields such as 'prompt' and 'response', "
            f"or 'messages'), got a {type(obj).__name__}."
        )
    return obj


class JsonSource(RecordSource):
    """A `.json` file: an array of objects (parsed whole), or JSON lines under a `.json` name."""

    kind, unit = "JSON file", "B"

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path
        self.total = path.stat().st_size

    def _starts_with_array(self) -> bool:
        with self.path.open("rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        return head.startswith(b"[")

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        if not self._starts_with_array():  # JSON lines in a .json file
            lines = JsonlSource(self.path)
            for item in lines:
                self.consumed, self.rows = lines.consumed, lines.rows
                yield item
            return
        try:
            items = json.loads(self.path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise DataError(f"{self.path}: not valid UTF-8 ({exc.reason} at byte {exc.start}).") from None
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{self.path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno}); a .json data file "
                "is one array of objects, or one object per line."
            ) from None
        self.consumed = self.total
        for index, obj in enumerate(items):
            where = f"{self.path} item {index}"
            self.rows = index + 1
            yield where, _as_record(obj, where)

    def fingerprint(self) -> str:
        return content_sha256(self.path)


class CsvSource(RecordSource):
    """A header row, then one record per row (`.tsv`: tab-separated); every value is a string."""

    kind, unit = "CSV file", "B"

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path
        self.total = path.stat().st_size

    def _lines(self, f: io.TextIOBase) -> Iterator[str]:
        for line in f:
            self.consumed += len(line)  # characters, not bytes: close enough for a progress bar
            yield line

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        delimiter = "\t" if self.path.suffix.lower() == ".tsv" else ","
        with self.path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(self._lines(f), delimiter=delimiter)
            try:
                for row in reader:
                    where = f"{self.path}:{reader.line_num}"
                    self.rows += 1
                    if None in row:  # DictReader files cells beyond the header's columns under None
                        raise DataError(
                            f"{where}: more cells than the header's {len(reader.fieldnames or [])} columns; "
                            f"quote cells that contain {delimiter!r}."
                        )
                    yield where, dict(row)
            except UnicodeDecodeError as exc:
                raise DataError(f"{self.path}: not valid UTF-8 ({exc.reason}); save it as UTF-8.") from None
            except csv.Error as exc:
                raise DataError(f"{self.path}:{reader.line_num}: invalid CSV ({exc}).") from None

    def fingerprint(self) -> str:
        return content_sha256(self.path)


class ParquetSource(RecordSource):
    """A Parquet file, read one row batch at a time with pyarrow."""

    kind, unit = "Parquet file", "rows"
    BATCH_ROWS = 1024

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path
        self._file = self._open()
        self.total = self._file.metadata.num_rows

    def _open(self) -> Any:
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses for a bad file
            raise DataError(f"{self.path}: not a readable Parquet file ({_first_line(exc)}).") from None

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        row = 0
        for batch in self._file.iter_batches(batch_size=self.BATCH_ROWS):
            for record in batch.to_pylist():
                row += 1
                self.consumed = self.rows = row
                yield f"{self.path} row {row}", record

    def fingerprint(self) -> str:
        return content_sha256(self.path)


# ---------------------------------------------------------------- datasets library


class DatasetSource(RecordSource):
    """A `datasets.Dataset`: loaded from a `save_to_disk` folder or a hub id, memory-mapped Arrow on disk."""

    unit = "rows"

    def __init__(self, name: str, kind: str, dataset: Any, split: str | None) -> None:
        super().__init__(name)
        self.kind = kind
        self.dataset = dataset
        self.split = split
        self.total = len(dataset)

    def describe(self) -> str:
        split = f", split {self.split!r}" if self.split else ""
        return f"{self.name} ({self.kind}{split})"

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        label = f"{self.name} [{self.split}]" if self.split else self.name
        for row, record in enumerate(self.dataset, start=1):
            self.consumed = self.rows = row
            yield f"{label} row {row}", record

    def fingerprint(self) -> str | None:
        # The Arrow files the dataset is mapped from: written once by `datasets`, so their bytes are the
        # content. A dataset only in memory has none, and is not cached.
        files = [Path(f["filename"]) for f in self.dataset.cache_files]
        if not files:
            return None
        return f"{self.split}:{files_sha256(files)}"


def _quiet_datasets() -> None:
    """`datasets` prints a progress bar per split and warns about offline fallbacks: zerofit says it itself."""
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def _pick_split(obj: Any, name: str, split: str, key: str) -> tuple[Any, str | None]:
    """The split `split` of a DatasetDict (a Dataset has none)."""
    import datasets

    if isinstance(obj, datasets.Dataset):
        return obj, None
    if split not in obj:
        available = ", ".join(repr(s) for s in obj) or "none"
        raise DataError(
            f"{key} = {name!r} has no split {split!r} (splits: {available}); set data.split (or, for "
            "data.eval_path, data.eval_split) to one of them."
        )
    return obj[split], split


def _saved_dataset(path: Path, split: str, key: str) -> DatasetSource:
    has_dataset = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    if not has_dataset:
        raise DataError(
            f"{key} = {str(path)!r} is a folder but not one written by `datasets` save_to_disk (no state.json "
            "or dataset_dict.json in it); point it at a data file (.jsonl, .json, .parquet, .csv) or at a "
            "save_to_disk folder."
        )
    import datasets

    _quiet_datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged folder: missing Arrow files, bad JSON, another datasets version
        raise DataError(
            f"{key} = {str(path)!r}: `datasets.load_from_disk` could not read it ({_first_line(exc)})."
        ) from None
    dataset, chosen = _pick_split(loaded, str(path), split, key)
    return DatasetSource(str(path), "save_to_disk folder", dataset, chosen)


def _hub_dataset(name: str, split: str, subset: str | None, key: str) -> DatasetSource:
    import datasets

    _quiet_datasets()
    try:
        dataset = datasets.load_dataset(name, subset, split=split)
    except ValueError as exc:
        if "Unknown split" in str(exc) or "Bad split" in str(exc):
            raise DataError(
                f"{key} = {name!r}: {_first_line(exc)}; set data.split (or data.eval_split for the eval data) "
                "to a split the dataset has."
            ) from None
        raise DataError(
            f"{key} = {name!r}: the hub dataset could not be loaded ({_first_line(exc)})."
        ) from None
    except Exception as exc:  # no network and no cache, unknown or gated repo, broken files
        raise DataError(
            f"{key} = {name!r} is not a local file or folder, and loading it as a hub dataset id failed "
            f"({type(exc).__name__}: {_first_line(exc)}). Offline (HF_HUB_OFFLINE=1) a hub dataset loads only "
            "from the `datasets` cache of an earlier online load; otherwise check the id (org/name), log in "
            f"for a gated dataset (`hf auth login`), or point {key} at a local file."
        ) from None
    return DatasetSource(name, "hub dataset", dataset, split)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------- dispatch

# One reader per kind of data file (`zerofit.core.data_files` says which suffix is which kind).
_READERS: dict[DataFileKind, type[RecordSource]] = {
    "jsonl": JsonlSource,
    "json": JsonSource,
    "parquet": ParquetSource,
    "csv": CsvSource,
}


def open_source(
    path: str | Path, *, split: str = "train", subset: str | None = None, key: str = "data.path"
) -> RecordSource:
    """The record source `path` names (see the module docstring); `key` is the config key, for messages.

    `split` / `subset` select a split and configuration of a hub dataset, and a split of a saved
    DatasetDict; local files have no splits.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        return _saved_dataset(local, split, key)
    if local.is_file():
        kind = DATA_FILE_KINDS.get(local.suffix.lower(), "jsonl")  # any other suffix: read as JSONL
        return _READERS[kind](local)  # type: ignore[call-arg]
    text = str(path)
    if looks_like_hub_id(text):
        return _hub_dataset(text, split, subset, key)
    suffixes = ", ".join(DATA_FILE_SUFFIXES)
    raise DataError(
        f"{key} = {text!r}: file does not exist; point {key} at a data file ({suffixes}), a `datasets` "
        "save_to_disk folder, or a hub dataset id (org/name)."
    )
