"""The tokenization cache: a second run on the same data starts without tokenizing it again.

An entry is keyed by everything that decides the tokens: the source's content hash (`records.py`), the
tokenizer (its full serialized definition, special tokens and chat template), the data format, max_seq_len
and `PIPELINE_VERSION` (bumped whenever zerofit's tokenization changes). It lives in
`$ZEROFIT_CACHE/tokenized/<key>/` as flat arrays (int32 ids, a one-byte label mask, example offsets, the
record of each example) plus `meta.json`, written to a temporary folder and renamed into place, so a reader never sees
half an entry and ranks or runs racing to write it are harmless. Delete the folder to reclaim the space.

An entry is data from disk, so it is checked against what it claims before anything trains on it
(`entry_problem`): `meta.json` carries a SHA-256 of the arrays and the rest of the meta (written with the
entry), and the arrays must make examples as zerofit makes them: ids within the tokenizer's vocabulary, a
0/1 label mask that leaves every example at least one learned token, offsets from 0 up to the token count,
one record per example. An entry that fails (edited, cut short, from an older zerofit without the digest,
or a planted pickle, which `np.load` refuses) is tokenized again and replaced, with a one-line note naming
the entry and the failed check. The digest shows only accidental change (whoever writes an entry can write
its digest): the loaders also check a sound entry against its source on a sample of records
(`zerofit.data.cache_check`), and `discard_entry` removes one that does not match.
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

from zerofit.core.digest import file_sha256
from zerofit.models.tiny import cache_dir
from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = [
    "PIPELINE_VERSION",
    "CachedData",
    "cache_key",
    "discard_entry",
    "entry_problem",
    "load_cached",
    "save_cached",
    "tokenizer_fingerprint",
    "vocab_size",
]

# Bump when zerofit tokenizes, masks, truncates or chunks differently. 2: a response or text that already
# ends in the eos token gets no second one (`zerofit.data.tokenize.ending_in_eos`). 3: conversations render
# with their `tools`, tool calls normalized (`zerofit.data.tools`).
PIPELINE_VERSION = 3
_ARRAYS = ("input_ids", "label_mask", "offsets", "records")
_DTYPES = {"input_ids": np.int32, "label_mask": np.uint8, "offsets": np.int64, "records": np.int64}
_BLOCK_TOKENS = 1 << 20  # tokens turned into lists at a time when loading
_DIGEST = "digest"  # meta.json's key for the entry's content hash (`_content_digest`)
_EXAMPLES = "examples"  # meta.json's key for the number of examples the entry holds
_ATTACHED = "attached"  # meta.json's key for the entry's further files (`save_cached`'s `attachments`)


def vocab_size(tokenizer: Any) -> int:
    """How many token ids `tokenizer` has (added tokens included): every cached id lies below it."""
    return len(tokenizer)


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
    key: str,
    ids: list[list[int]],
    labels: list[list[int]],
    records: list[int],
    meta: dict[str, Any],
    vocab: int,
    attachments: dict[str, bytes] | None = None,
) -> Path | None:
    """Write an entry atomically (a concurrent writer of the same key loses harmlessly), with its digest.

    Labels are stored as a one-byte mask over the ids: every zerofit label is either its token's id or
    IGNORE_INDEX. Examples that break that rule are not cached (None): nothing zerofit makes does. `vocab`:
    the tokenizer's `vocab_size`, to judge an entry already there. `attachments`: further files of the
    entry by name (a vision entry's image tensors, safetensors), covered by the digest like the arrays.
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
        for name, blob in (attachments or {}).items():
            (tmp / name).write_bytes(blob)
        claimed = {**meta, _EXAMPLES: len(ids), **({_ATTACHED: sorted(attachments)} if attachments else {})}
        digest = _content_digest(tmp, claimed)
        (tmp / "meta.json").write_text(json.dumps({**claimed, _DIGEST: digest}, indent=2) + "\n")
        _place(tmp, target, vocab)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _place(tmp: Path, target: Path, vocab: int) -> None:
    """Rename the written entry `tmp` to `target`; an entry already there is kept when it is sound (another
    rank or run wrote it first: same key, same content) and replaced when it is not (it would be tokenized
    again on every run). `load_cached` already said what was wrong with it."""
    try:
        os.rename(tmp, target)
    except OSError:
        if entry_problem(target, vocab) is None:
            return
        old = _set_aside(target)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)


def _set_aside(target: Path) -> Path:
    """Move the entry `target` into a new hidden folder beside it (one rename: a reader sees the whole entry
    or none) and return that folder, for the caller to delete."""
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / target.name)
    return old


def discard_entry(key: str) -> None:
    """Remove the entry for `key` (one that does not match its source: `zerofit.data.cache_check`), so
    that the entry written next takes its place."""
    target = entry_dir(key)
    if target.exists():
        shutil.rmtree(_set_aside(target), ignore_errors=True)


def _content_digest(folder: Path, claimed: dict[str, Any]) -> str:
    """SHA-256 of the entry's array files (bytes, in `_ARRAYS` order), its attached files and its meta
    without the digest."""
    digest = hashlib.sha256()
    for name in _ARRAYS:
        digest.update(f"{name}:{file_sha256(folder / f'{name}.npy')}\0".encode())
    for name in claimed.get(_ATTACHED, []):
        digest.update(f"{name}:{file_sha256(folder / name)}\0".encode())
    digest.update(json.dumps(claimed, sort_keys=True).encode())
    return digest.hexdigest()


def entry_problem(folder: Path, vocab: int) -> str | None:
    """What is wrong with the entry `folder` for a tokenizer of `vocab` ids (one clause, naming the file and
    the failed check), or None for a sound entry.

    Read without pickles (`np.load`'s default): a planted pickle is a file that cannot be read.
    """
    arrays: dict[str, np.ndarray] = {}
    file = "meta.json"
    try:
        meta = json.loads((folder / file).read_text())
        for name in _ARRAYS:
            file = f"{name}.npy"
            arrays[name] = np.load(folder / file, mmap_mode="r")
    except (OSError, ValueError) as exc:
        return f"could not be read ({file}: {type(exc).__name__}: {exc})"
    if not isinstance(meta, dict) or not isinstance(meta.get(_DIGEST), str):
        return "has no content digest in meta.json (written by an older zerofit)"
    claimed = {k: v for k, v in meta.items() if k != _DIGEST}
    problem = (
        _attached_problem(folder, claimed.get(_ATTACHED, []))
        or _shape_problem(arrays, claimed.get(_EXAMPLES))
        or _value_problem(arrays, vocab)
    )
    if problem is not None:
        return problem
    if _content_digest(folder, claimed) != meta[_DIGEST]:
        return "does not match the content digest in meta.json (edited or corrupted since it was written)"
    return None


def _attached_problem(folder: Path, names: Any) -> str | None:
    """Whether the attached files meta.json names are plain files of the entry (a name cannot lead out)."""
    if not isinstance(names, list) or not all(isinstance(n, str) and Path(n).name == n for n in names):
        return f"meta.json names attached files {names!r:.80}, not plain file names"
    lost = [name for name in names if not (folder / name).is_file()]
    return f"lacks its attached file {lost[0]}" if lost else None


def _shape_problem(arrays: dict[str, np.ndarray], examples: Any) -> str | None:
    """Whether the arrays have the dtypes and lengths of `examples` examples (the count meta.json claims)."""
    for name, dtype in _DTYPES.items():
        array = arrays[name]
        if array.dtype != dtype or array.ndim != 1:
            return f"{name}.npy holds {array.ndim}-D {array.dtype}, not 1-D {np.dtype(dtype)} as written"
    if not isinstance(examples, int) or isinstance(examples, bool) or examples < 1:
        return f"meta.json claims {examples!r} examples, not a positive count"
    tokens = len(arrays["input_ids"])
    wanted = {"label_mask": tokens, "offsets": examples + 1, "records": examples}
    for name, length in wanted.items():
        if len(arrays[name]) != length:
            have = len(arrays[name])
            return f"{name}.npy holds {have} values where {examples} examples ({tokens} tokens) need {length}"
    return None


def _value_problem(arrays: dict[str, np.ndarray], vocab: int) -> str | None:
    """Whether the values are those of zerofit examples (the shapes are right: `_shape_problem`)."""
    ids, mask, offsets, records = (arrays[name] for name in _ARRAYS)
    steps = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != len(ids) or (steps < 0).any():
        return f"offsets.npy is not non-decreasing from 0 to the token count {len(ids)}"
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
        return (
            f"input_ids.npy holds id {int(ids[bad])} at token {bad}, outside the tokenizer's ids [0, {vocab})"
        )
    if len(mask) and int(mask.max()) > 1:
        return "label_mask.npy holds values other than 0 and 1"
    if (steps < 2).any() or not _every_example_learns(mask, offsets):
        return "label_mask.npy leaves an example without a learned token (zerofit keeps none such)"
    if int(records[0]) < 0 or (np.diff(records) < 0).any():
        return "records.npy is not a non-decreasing list of record numbers from 0"
    return None


def _every_example_learns(mask: np.ndarray, offsets: np.ndarray) -> bool:
    """Whether every example has a learned label after its first position (which predicts nothing)."""
    starts = np.asarray(offsets[:-1])
    learned = np.add.reduceat(mask, starts, dtype=np.int64) - np.asarray(mask[starts], dtype=np.int64)
    return bool((learned > 0).all())


def load_cached(key: str, vocab: int) -> CachedData | None:
    """The entry for `key`, or None when there is none or it fails a check (`entry_problem`: then the
    caller tokenizes again and `save_cached` replaces it; a one-line note says which check failed).

    `vocab` is the tokenizer's `vocab_size`. The arrays are memory-mapped and turned into lists a block of
    about `_BLOCK_TOKENS` tokens at a time, so loading holds little beyond the examples themselves; an
    example learned on every token shares one list for its ids and labels.
    """
    folder = entry_dir(key)
    if not folder.exists():
        return None
    problem = entry_problem(folder, vocab)
    if problem is not None:
        print(
            f"zerofit: tokenization cache entry {folder} {problem}: tokenizing the data again, replacing it",
            file=sys.stderr,
            flush=True,
        )
        return None
    meta = json.loads((folder / "meta.json").read_text())
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
    ids, labels = _examples(arrays["input_ids"], arrays["label_mask"], arrays["offsets"].tolist())
    return CachedData(ids, labels, arrays["records"].tolist(), meta)


def _examples(
    flat_ids: np.ndarray, mask: np.ndarray, offsets: list[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """The (ids, labels) lists of the examples the flat arrays hold, a block of examples at a time."""
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
    return ids, labels
