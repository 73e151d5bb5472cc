"""Where a vision-language model's records come from, and the digest of the images they name.

Every source `records.open_source` reads works (JSONL / JSON / Parquet / CSV files, a `save_to_disk` folder,
a hub dataset id), plus a folder in the Hugging Face `imagefolder` layout: images beside a `metadata.jsonl`
(or `.csv` / `.parquet`) whose rows name their image (`file_name`, or a list: `file_names`) and hold the
conversation (`messages`), read through `datasets.load_dataset("imagefolder")` (its column `image` or
`images`).

A `datasets` source is read with its Image columns undecoded (`{"bytes", "path"}` as stored): the image is
opened by `zerofit.data.vision.open_image`, so an undecodable one is a `data.missing_images` case like a
missing file, never a traceback from inside `datasets`; and its bytes are what the tokenization cache keys on
(`images_digest`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from zerofit.core.data_files import DATA_FILE_SUFFIXES
from zerofit.core.digest import content_sha256
from zerofit.core.errors import DataError
from zerofit.data.records import DatasetSource, RecordSource, _first_line, _quiet_datasets, open_source

__all__ = ["IMAGE_FOLDER_METADATA", "images_digest", "open_vision_source"]

# The metadata files `datasets`' imagefolder builder reads beside the images.
IMAGE_FOLDER_METADATA = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
_SAVED = ("state.json", "dataset_dict.json")  # a `save_to_disk` folder's marks (`records._saved_dataset`)
_BATCH_ROWS = 256  # rows turned into Python records at a time


class UndecodedDatasetSource(DatasetSource):
    """A `datasets.Dataset` read as stored: Image values stay `{"bytes", "path"}` dicts (decoded by zerofit,
    so a bad image is counted, not raised by `datasets`)."""

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        label = f"{self.name} [{self.split}]" if self.split else self.name
        table = self.dataset.with_format("arrow")
        for start in range(0, len(table), _BATCH_ROWS):
            for offset, record in enumerate(table[start : start + _BATCH_ROWS].to_pylist()):
                self.consumed = self.rows = start + offset + 1
                yield f"{label} row {self.rows}", record


def _undecoded(source: RecordSource) -> RecordSource:
    if isinstance(source, DatasetSource):
        return UndecodedDatasetSource(source.name, source.kind, source.dataset, source.split)
    return source


def _image_folder(path: Path, split: str, key: str) -> DatasetSource:
    """An `imagefolder` layout (images and a metadata file) through `datasets`."""
    import datasets

    _quiet_datasets()
    try:
        dataset = datasets.load_dataset("imagefolder", data_dir=str(path), split=split)
    except Exception as exc:  # a bad metadata file, no images, an unknown split
        raise DataError(
            f"{key} = {str(path)!r}: `datasets` could not read it as an image folder ({_first_line(exc)}); an "
            "image folder holds the images and a metadata.jsonl whose rows name their image ('file_name', or "
            "a list: 'file_names', relative to the folder) beside a 'messages' conversation."
        ) from None
    return DatasetSource(str(path), "image folder", dataset, split)


def open_vision_source(
    path: str | Path, *, split: str = "train", subset: str | None = None, key: str = "data.path"
) -> tuple[RecordSource, Path]:
    """The record source `path` names for a vision-language model, and the folder image paths are relative
    to (the data file's, or the folder's). A folder that is neither a `save_to_disk` folder nor an image
    folder is refused in one paragraph naming the layouts that are read."""
    local = Path(path).expanduser()
    if local.is_dir() and not any((local / mark).is_file() for mark in _SAVED):
        if not any((local / name).is_file() for name in IMAGE_FOLDER_METADATA):
            raise DataError(
                f"{key} = {str(local)!r} is a folder with neither a metadata file ({', '.join(IMAGE_FOLDER_METADATA)}) "
                "nor a `datasets` save_to_disk folder's state.json. A vision-language model reads: a data file "
                f"({', '.join(DATA_FILE_SUFFIXES)}) of conversations naming their images (paths relative to the "
                "file), a save_to_disk folder or hub dataset with a 'messages' column and an 'images' column of "
                "datasets.Image values, or an image folder (the images and a metadata.jsonl whose rows hold "
                "'file_name' and 'messages')."
            )
        return _undecoded(_image_folder(local, split, key)), local
    source = open_source(path, split=split, subset=subset, key=key)
    return _undecoded(source), local.parent if local.is_file() else local


def _image_sha(ref: Any, base: Path) -> str:
    """What decides the pixels of one image reference: the SHA-256 of its bytes (a file's, or a `datasets`
    Image's), `missing:...` for a file that is not there, `null` for a null value."""
    if isinstance(ref, dict) and ref.get("bytes") is not None:
        return hashlib.sha256(ref["bytes"]).hexdigest()
    if hasattr(ref, "tobytes") and hasattr(ref, "size"):  # an opened PIL image
        return hashlib.sha256(f"{ref.mode}{ref.size}".encode() + ref.tobytes()).hexdigest()
    name = ref.get("path") if isinstance(ref, dict) else ref
    if name is None:
        return "null"
    file = Path(str(name)).expanduser()
    file = file if file.is_absolute() else base / file
    try:
        return content_sha256(file)
    except OSError:
        return f"missing:{name}"


def images_digest(source: RecordSource, base: Path, refs: Callable[[dict[str, Any], str], list[Any]]) -> str:
    """One SHA-256 over every image the records of `source` name (`refs(record, where)`), in order: an
    edited, added or removed image file changes it, so the tokenization cache misses."""
    digest = hashlib.sha256()
    for where, record in source:
        for ref in refs(record, where):
            digest.update(f"{_image_sha(ref, base)}\0".encode())
        digest.update(b"\n")
    return digest.hexdigest()
