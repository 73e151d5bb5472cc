"""The checkpoint manifest: what a complete checkpoint holds, and the proof that it is still intact.

`manifest.json` is written last into `step-N.tmp/`, by rank 0, after every rank's files are on disk; the
folder is renamed to `step-N/` only then. So a folder with a manifest is a complete checkpoint, and the
manifest says what it must contain: every file with its size and SHA-256, plus the facts a resume is checked
against (the resolved config, the batch plan, the world size, the engine's checkpoint format, the data
file's fingerprint, the step).

`verify()` re-reads every listed file: a missing, truncated or altered file, or a `step-N` folder whose
manifest names another step, makes the checkpoint unusable (and resume falls back to an older one, setting
this one aside as `step-N.damaged`) instead of failing deep inside an engine's loader. Pure Python:
no torch, so a resume is judged before any model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from zerofit.core.digest import content_sha256, file_sha256
from zerofit.core.run_layout import STEP_DIR_GLOB, step_of_dir

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# Set (true) in the manifest of the checkpoint written when early stopping ended the run: the run is
# finished, and a resume says so instead of training on (`resume._check_early_stop`).
EARLY_STOPPED = "early_stopped"


def data_fingerprint(path: str | Path) -> dict[str, Any]:
    """Size and SHA-256 of the training data: a resume compares the data by content, not by its path's
    spelling. A folder (`datasets` save_to_disk) is hashed over its files' names and contents; a hub dataset
    id has no local content to hash (`sha256` None: not compared, the id itself is a config key)."""
    source = Path(path).expanduser()
    if source.is_file():
        return {"size": source.stat().st_size, "sha256": content_sha256(source)}
    if source.is_dir():
        digest, size = hashlib.sha256(), 0
        for name in listed_files(source):
            size += (source / name).stat().st_size
            digest.update(f"{name}\0{content_sha256(source / name)}\0".encode())
        return {"size": size, "sha256": digest.hexdigest()}
    return {"size": None, "sha256": None, "hub_id": str(path)}


def listed_files(folder: Path) -> list[str]:
    """Every file under `folder` (relative, sorted), the manifest itself left out."""
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def describe_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """`{name: {"size", "sha256"}}` for the files `names` of `folder` (each rank describes its share)."""
    return {
        name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)} for name in names
    }


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write `manifest.json` into `folder` atomically (a torn manifest would pass for a complete checkpoint)."""
    path = folder / MANIFEST
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT_VERSION, **manifest}, indent=1, sort_keys=True) + "\n")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder; raises ValueError when it is unreadable or not a manifest."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{MANIFEST} is unreadable ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or "step" not in data:
        raise ValueError(f"{MANIFEST} is not a zerofit checkpoint manifest")
    return data


def verify(folder: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) of a checkpoint folder: problems is empty when every listed file is intact."""
    if not (folder / MANIFEST).exists():
        what = "is empty" if not any(folder.iterdir()) else f"has no {MANIFEST}"
        return None, [f"the folder {what} (emptied, or its manifest deleted): it cannot be verified"]
    try:
        manifest = read_manifest(folder)
    except ValueError as exc:
        return None, [str(exc)]
    mismatch = _step_mismatch(folder, manifest)
    if mismatch is not None:
        return manifest, [mismatch]
    problems = []
    for name, meta in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != meta.get("size"):
            problems.append(f"{name} is {size:,} bytes, the manifest says {meta.get('size'):,}")
        elif file_sha256(path) != meta.get("sha256"):
            problems.append(f"{name} does not match its SHA-256 (changed on disk)")
    return manifest, problems


def _step_mismatch(folder: Path, manifest: dict[str, Any]) -> str | None:
    """Why a `step-N` folder's manifest does not describe step N (a folder renamed or copied over another),
    or None: a resume would start at the manifest's step while believing it resumed step N."""
    named = step_of_dir(folder.name)
    saved = manifest.get("step")
    if named is None or (isinstance(saved, int) and not isinstance(saved, bool) and saved == named):
        return None
    return (
        f"the folder is {folder.name} but its {MANIFEST} says step {saved!r} (renamed, or copied from another "
        "checkpoint): which step it holds is unknown"
    )


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-N` folder under `root`, complete or not, oldest first: what a resume
    looks at, so that a newest folder without a manifest (emptied, its manifest deleted) is reported, not
    silently passed over."""
    found = []
    for folder in root.glob(STEP_DIR_GLOB) if root.is_dir() else []:
        step = step_of_dir(folder.name)
        if step is not None and folder.is_dir():
            found.append((step, folder))
    return sorted(found)


def checkpoint_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every folder under `root` that holds a manifest (complete checkpoints), oldest first."""
    return [(step, folder) for step, folder in step_folders(root) if (folder / MANIFEST).is_file()]
