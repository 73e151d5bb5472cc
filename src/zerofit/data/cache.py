"""The tokenization cache: a second run on the same data starts without tokenizing it again.

An entry is keyed by everything that decides the tokens: the source's content hash (`records.py`), the
tokenizer (its full serialized definition, special tokens and chat template), the data format, max_seq_len
and `PIPELINE_VERSION` (bumped whenever zerofit's tokenization changes). It lives in
`$ZEROFIT_CACHE/tokenized/<key>/` as flat arrays (int32 ids, a one-byte label mask, example offsets, the
record of each example) plus `meta.json`, written to a temporary folder and renamed into place, so a reader never sees
half an entry and ranks or runs racing to write it are harmless. Delete the folder to reclaim the space.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from zerofit.loss import IGNORE_INDEX
from zerofit.tiny_llama import cache_dir

__all__ = [
    "PIPELINE_VERSION",
    "CachedData",
    "cache_key",
    "load_cached",
    "save_cached",
    "tokenizer_fingerprint",
]

PIPELINE_VERSION = 1  # bump when zerofit tokenizes, masks, truncates or chunks differently
_ARRAYS = ("input_ids", "label_mask", "offsets", "records")
_BLOCK_TOKENS = 1 << 20  # tokens turned into lists at a time when loading


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what the tokenizer does: its serialized definition (fast tokenizers), vocabulary otherwise,
    special tokens and chat template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "map": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    digest.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(**parts: Any) -> str:
    """The entry name for these key parts (JSON-able values)."""
    blob = json.dumps({"pipeline": PIPELINE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:40]


def entry_dir(key: str) -> Path:
    return cache_dir() / "tokenized" / key


class CachedData:
    """What a cache entry holds: the examples as (ids, labels) lists, each example's record, and `meta`."""

    def __init__(
        self, ids: list[list[int]], labels: list[list[int]], records: list[int], meta: dict[str, Any]
    ) -> None:
        self.ids, self.labels, self.records, self.meta = ids, labels, records, meta


def save_cached(
    key: str, ids: list[list[int]], labels: list[list[int]], records: list[int], meta: dict[str, Any]
) -> Path | None:
    """Write an entry atomically (a concurrent writer of the same key loses harmlessly).

    Labels are stored as a one-byte mask over the ids: every zerofit label is either its token's id or
    IGNORE_INDEX. Examples that break that rule are not cached (None): nothing zerofit makes does.
    """
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    flat_ids = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=n)
    flat_labels = np.fromiter(itertools.chain.from_iterable(labels), dtype=np.int32, count=n)
    mask = flat_labels != IGNORE_INDEX
    if not np.array_equal(flat_labels[mask], flat_ids[mask]):
        return None
    target = entry_dir(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=target.parent))
    try:
        arrays = {
            "input_ids": flat_ids,
            "label_mask": mask.astype(np.uint8),
            "offsets": offsets,
            "records": np.asarray(records, dtype=np.int64),
        }
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # an entry is there: another rank or run wrote it first (same key, same content) ...
            problem = _unreadable(target)
            if problem is not None:  # ... or it is broken, and would be re-tokenized on every run: replace it
                print(
                    f"zerofit: tokenization cache entry {target} could not be read ({problem}): replacing it",
                    file=sys.stderr,
                    flush=True,
                )
                old = Path(tempfile.mkdtemp(prefix=f".{key}.old-", dir=target.parent))
                os.rename(target, old / key)
                os.rename(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _unreadable(folder: Path) -> str | None:
    """Why the entry `folder` cannot be loaded (a file missing, truncated or not what it should be), or None."""
    try:
        json.loads((folder / "meta.json").read_text())
        for name in _ARRAYS:
            np.load(folder / f"{name}.npy", mmap_mode="r")
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def load_cached(key: str) -> CachedData | None:
    """The entry for `key`, or None when there is none (or it cannot be read: then it is rebuilt).

    The arrays are memory-mapped and turned into lists a block of about `_BLOCK_TOKENS` tokens at a time,
    so loading holds little beyond the examples themselves; an example learned on every token shares one
    list for its ids and labels.
    """
    folder = entry_dir(key)
    if _unreadable(folder) is not None:
        return None
    meta = json.loads((folder / "meta.json").read_text())
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    flat_ids, mask, offsets = arrays["input_ids"], arrays["label_mask"], arrays["offsets"].tolist()
    n = len(offsets) - 1
    ids: list[list[int]] = []
    labels: list[list[int]] = []
    first = 0
    while first < n:
        last = first + 1  # examples [first, last) make one block
        while last < n and offsets[last + 1] - offsets[first] <= _BLOCK_TOKENS:
            last += 1
        base, end = offsets[first], offsets[last]
        block_mask = np.asarray(mask[base:end], dtype=bool)
        block_ids = np.asarray(flat_ids[base:end])
        id_list = block_ids.tolist()
        label_list = np.where(block_mask, block_ids, IGNORE_INDEX).tolist()
        for k in range(first, last):
            a, b = offsets[k] - base, offsets[k + 1] - base
            ids.append(id_list[a:b])
            labels.append(ids[-1] if block_mask[a:b].all() else label_list[a:b])
        first = last
    return CachedData(ids, labels, arrays["records"].tolist(), meta)
