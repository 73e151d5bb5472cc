"""Read a W&B run file (`run-*.wandb`) back without network: history rows, config and summary.

The file is wandb's transaction log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB blocks
of records in the LevelDB log format (each chunk: crc32 u32, length u16, type u8 = full/first/middle/last;
a chunk never straddles a block, and a block tail shorter than a chunk header is zero padding). Every
assembled record is a protobuf `wandb.proto.wandb_internal_pb2.Record`. Older wandb shipped a Python reader
(`wandb/sdk/internal/datastore.py`); 0.31 writes the file from its Go core and has no Python reader, so
this module reads the format directly. Used by the e2e test (what reached W&B equals `metrics.jsonl`) and by
`zerofit compare` for runs that only have W&B files.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32 * 1024
FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK_HEADER = struct.Struct("<IHB")  # crc32, length, type
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
STEP_KEY = "_step"
WANDB_RUN_GLOB = "run-*.wandb"  # a W&B run file, under a run folder's wandb/*/


class WandbFileError(ValueError):
    """The file is not a W&B transaction log, or is corrupt (bad checksum, broken chunk sequence)."""


def _crc(chunk_type: int, data: bytes) -> int:
    # LevelDB-style: the checksum covers the type byte, then the payload.
    return zlib.crc32(data, zlib.crc32(bytes([chunk_type]))) & 0xFFFFFFFF


def iter_record_bytes(path: str | Path, *, verify: bool = True) -> Iterator[bytes]:
    """The serialized records of a `.wandb` file, in order. A torn last record (crash) is ignored."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER.size:
        raise WandbFileError(f"{path}: too short for a W&B file header")
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if ident != IDENT or magic != MAGIC or version != VERSION:
        raise WandbFileError(f"{path}: not a W&B run file (header {ident!r}, magic {magic:#x}, v{version})")
    pos = FILE_HEADER.size
    pending: list[bytes] | None = None
    while pos + CHUNK_HEADER.size <= len(data):
        block_left = BLOCK_SIZE - pos % BLOCK_SIZE
        if block_left < CHUNK_HEADER.size:
            pos += block_left  # zero padding at the end of a block
            continue
        crc, length, chunk_type = CHUNK_HEADER.unpack_from(data, pos)
        start = pos + CHUNK_HEADER.size
        payload = data[start : start + length]
        if chunk_type == 0 and length == 0:
            break  # zeroed tail: the writer pre-allocated or stopped here
        if len(payload) < length:
            break  # torn write at the end of the file
        if verify and _crc(chunk_type, payload) != crc:
            raise WandbFileError(f"{path}: checksum mismatch at byte {pos}")
        pos = start + length
        if chunk_type == FULL:
            yield payload
        elif chunk_type == FIRST:
            pending = [payload]
        elif chunk_type in (MIDDLE, LAST) and pending is not None:
            pending.append(payload)
            if chunk_type == LAST:
                yield b"".join(pending)
                pending = None
        else:
            raise WandbFileError(f"{path}: unexpected chunk type {chunk_type} at byte {pos}")


def _item_key(item: Any) -> str:
    # Nested keys ("a" / "b") come back as "a/b", as wandb shows them.
    return "/".join(item.nested_key) if item.nested_key else item.key


def _history_value(item: Any) -> Any:
    kind = item.WhichOneof("value") if _has_value_oneof(item) else None
    if kind == "none":
        return None
    if kind in ("boolean", "integer", "number", "text"):
        return getattr(item, kind)
    if kind == "json":
        return json.loads(item.json)
    return json.loads(item.value_json) if item.value_json else None


def _has_value_oneof(item: Any) -> bool:
    return any(o.name == "value" for o in item.DESCRIPTOR.oneofs)


@dataclass
class WandbRun:
    """What a run file holds: history rows by step, config, summary and the run's identity."""

    path: Path
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""
    project: str = ""
    group: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)

    def series(self, key: str) -> list[tuple[int, Any]]:
        """`(step, value)` for every history row that has `key`, in step order."""
        return [(s, row[key]) for s, row in sorted(self.history.items()) if key in row]


def _apply_config(config: dict[str, Any], items: Any) -> None:
    for item in items:
        key = _item_key(item)
        value = json.loads(item.value_json) if item.value_json else None
        # wandb stores config values as {"value": v, "desc": ...}; `_wandb` is wandb's own metadata.
        if key == "_wandb":
            continue
        if isinstance(value, dict) and "value" in value:
            value = value["value"]
        config[key] = value


def read_wandb_run(path: str | Path, *, verify: bool = True) -> WandbRun:
    """Parse a `run-*.wandb` file (or the run folder holding one) into a `WandbRun`."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    if path.is_dir():
        path = find_run_file(path)
    run = WandbRun(path=path)
    for raw in iter_record_bytes(path, verify=verify):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_item_key(item): _history_value(item) for item in record.history.item}
            step = row.get(STEP_KEY, record.history.step.num)
            run.history.setdefault(int(step), {}).update(row)
        elif kind == "config":
            _apply_config(run.config, record.config.update)
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_item_key(item)] = json.loads(item.value_json) if item.value_json else None
        elif kind == "run":
            r = record.run
            run.run_id, run.project, run.group = r.run_id, r.project, r.run_group
            run.name, run.tags = r.display_name, list(r.tags)
            _apply_config(run.config, r.config.update)
    # The last history row's values are the summary wherever nothing explicit was set.
    if run.history:
        last = run.history[max(run.history)]
        for key, value in last.items():
            run.summary.setdefault(key, value)
    return run


def read_table(run: WandbRun, key: str, step: int) -> list[dict[str, Any]]:
    """The rows of table `key` logged at `step`, one dict per row. A `wandb.Table` reaches history as
    nested keys (`key/_type` = "table-file", `key/path`: a JSON file `{"columns": [...], "data": [[...]]}`
    under the run's `files/` folder)."""
    row = run.history.get(step, {})
    if row.get(f"{key}/_type") != "table-file":
        raise KeyError(f"no table {key!r} at step {step} in {run.path}")
    table = json.loads((run.path.parent / "files" / row[f"{key}/path"]).read_text())
    return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


def find_run_file(directory: str | Path) -> Path:
    """The newest `run-*.wandb` under `directory` (a run dir, its `wandb/` folder, or one W&B run folder)."""
    candidates = sorted(Path(directory).rglob(WANDB_RUN_GLOB), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise FileNotFoundError(f"no W&B run file (run-*.wandb) under {directory}")
    return candidates[-1]
