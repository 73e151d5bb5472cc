"""`zerofit export --out DIR`: what an export may replace in `DIR`, and the swap that replaces it.

Every export lists the files it wrote in its `zerofit_export.json` (`files`: paths relative to `DIR`). A later
export into the same `DIR` may remove exactly those, and nothing else: when `DIR` holds anything more (a
user's notes beside an export, a folder that is no export at all, a symlink), the export is refused before
anything loads, in one paragraph naming the folder and the files; nothing is written or deleted.

The listing is data like the rest of the folder: an entry counts only as a plain file inside `DIR` reached
without a symlink, named by a clean relative path (no `..`); anything else it names is ignored, so it can
never make an export delete what lies outside `DIR` or what the export did not write. A
`zerofit_export.json` without a listing (written by an older zerofit) allows the files an export of its
`kind` writes (`_KIND_FILES`: weights, config, tokenizer, card; GGUF: `<run_name>-<quant>.gguf` of zerofit's
own types, `Modelfile`); one with no kind (`{}`) allows only itself.

A Hugging Face export is written whole into a temporary sibling of `DIR` and swapped in when complete
(`replace_folder`): the earlier export is renamed aside, the new one takes its name, then the earlier
export's listed files are deleted; a failure before the swap leaves the earlier export as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

from zerofit.core.errors import ConfigError
from zerofit.core.messages import warn
from zerofit.core.run_layout import BASE_MODEL_FILE, EXPORT_INFO
from zerofit.export.gguf_writer import QUANTS

__all__ = [
    "EXPORT_INFO",
    "FILES_KEY",
    "MODELFILE",
    "MODEL_CARD",
    "OutFolder",
    "check_out",
    "read_out",
    "replace_folder",
    "unwritable_out",
    "written_files",
]

FILES_KEY = "files"  # its listing of the files the export wrote (relative POSIX paths)
MODEL_CARD = "README.md"
MODELFILE = "Modelfile"  # a GGUF export's Ollama Modelfile
_MAX_INFO_BYTES = 16 * 2**20  # a marker larger than this is no zerofit export's (it holds one config)
_SHOWN = 5  # unexpected files named in the refusal

# What an export of each kind writes, for a marker from before the listing (patterns of names in DIR itself).
_COMMON = (
    EXPORT_INFO,
    MODEL_CARD,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
_MODEL = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
_KIND_FILES: dict[str, tuple[str, ...]] = {
    "adapter": (*_COMMON, "adapter_config.json", "adapter_model.safetensors", BASE_MODEL_FILE),
    "merged": (*_COMMON, *_MODEL, "model-*-of-*.safetensors"),
    "model": (*_COMMON, *_MODEL, "model-*-of-*.safetensors"),
    "gguf": (EXPORT_INFO, MODEL_CARD, MODELFILE),
}


@dataclass(frozen=True)
class OutFolder:
    """What `--out` holds: the earlier export's `zerofit_export.json` ({} when there is none or it is not
    readable) and the files that export wrote there, which a new export may replace (relative paths of plain
    files inside the folder, sorted)."""

    path: Path
    info: dict[str, Any]
    files: tuple[str, ...]


def _is_plain_file(path: Path) -> bool:
    """A regular file, not a symlink (nor a FIFO or device a read could hang on)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_info(out: Path) -> dict[str, Any] | None:
    """`out`'s zerofit_export.json as a mapping; {} when it is there but unreadable, None when it is not."""
    path = out / EXPORT_INFO
    if not _is_plain_file(path):
        return None if not os.path.lexists(path) else {}
    try:
        if path.stat().st_size > _MAX_INFO_BYTES:
            return {}
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _clean(entry: Any) -> str | None:
    """A listing entry as a relative POSIX path inside the folder, or None (not a string, absolute, `..`, or
    not in its plain spelling: `a//b`, `./a`)."""
    if not isinstance(entry, str) or not entry:
        return None
    path = PurePosixPath(entry)
    if path.is_absolute() or ".." in path.parts or path.as_posix() != entry or "\\" in entry:
        return None
    return entry


def _gguf_files(info: dict[str, Any]) -> set[str]:
    """The GGUF files an export of `info`'s run could have written: `<run_name>-<quant>.gguf` of zerofit's types."""
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    stem = config.get("run_name") or Path(str(info.get("source_run") or "")).name
    return {f"{stem}-{quant}.gguf" for quant in QUANTS} if isinstance(stem, str) and stem else set()


def _replaceable(info: dict[str, Any]) -> tuple[set[str], tuple[str, ...]]:
    """The files an earlier export with marker `info` wrote: exact relative paths, and name patterns (DIR
    itself only) for a marker from before the listing."""
    if FILES_KEY in info:
        listed = info[FILES_KEY] if isinstance(info[FILES_KEY], list) else []
        return {name for name in map(_clean, listed) if name} | {EXPORT_INFO}, ()
    kind = info.get("kind")
    exact = _gguf_files(info) if kind == "gguf" else set()
    return exact | {EXPORT_INFO}, _KIND_FILES.get(kind, ()) if isinstance(kind, str) else ()


def _survey(out: Path, exact: set[str], patterns: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the replaceable files present, everything else) in `out`, as relative paths; a directory holding
    nothing, a symlink, or a folder that cannot be listed counts as something else."""
    present: list[str] = []
    unexpected: list[str] = []
    for dirpath, dirnames, filenames in os.walk(
        out, onerror=lambda exc: unexpected.append(f"{exc.filename}")
    ):
        base = Path(dirpath)
        rel_dir = base.relative_to(out).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        if prefix and not dirnames and not filenames:
            unexpected.append(prefix)  # an empty folder: not the export's either
        for name in [d for d in dirnames if (base / d).is_symlink()]:
            dirnames.remove(name)  # never followed
            unexpected.append(prefix + name)
        for name in filenames:
            rel = prefix + name
            ours = rel in exact or (not prefix and any(fnmatchcase(name, p) for p in patterns))
            (present if ours and _is_plain_file(base / name) else unexpected).append(rel)
    return sorted(present), sorted(unexpected)


def _refusal(out: Path, unexpected: list[str]) -> ConfigError:
    shown = ", ".join(unexpected[:_SHOWN]) + (
        f" and {len(unexpected) - _SHOWN} more" if len(unexpected) > _SHOWN else ""
    )
    them = "it" if len(unexpected) == 1 else "them"
    return ConfigError(
        [
            f"--out {out} holds files that are not a zerofit export's own ({shown}); an export replaces only "
            f"the files an earlier zerofit export wrote there (those its {EXPORT_INFO} lists), so nothing was "
            f"exported and nothing deleted: choose another --out (a new or empty folder), or move {them} out "
            f"of {out}"
        ]
    )


def read_out(out: Path) -> OutFolder:
    """What `out` holds (see the module docstring); a ConfigError naming the files when it holds anything an
    earlier export did not write there. A folder that does not exist holds nothing."""
    if not out.is_dir():
        return OutFolder(out, {}, ())
    info = _read_info(out)
    exact, patterns = _replaceable(info) if info is not None else (set(), ())
    present, unexpected = _survey(out, exact, patterns)
    if unexpected:
        raise _refusal(out, unexpected)
    return OutFolder(out, info or {}, tuple(present))


def written_files(folder: Path) -> list[str]:
    """The listing of an export written into `folder`: its files as relative POSIX paths, sorted, the
    marker included (it is written last)."""
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if _is_plain_file(p)}
    return sorted(found | {EXPORT_INFO})


def check_out(out: Path, run_dir: Path) -> OutFolder:
    """`--out` must not be the run itself, a file, or hold anything but an earlier export's own files
    (`read_out`: never delete what zerofit did not write), and must be writable; what it holds."""
    if out.resolve() == run_dir.resolve() or run_dir.resolve().is_relative_to(out.resolve()):
        raise ConfigError([f"--out {out} would replace the run directory {run_dir}; choose a new folder"])
    if out.exists() and not out.is_dir():
        raise ConfigError([f"--out {out} is a file; choose a new folder"])
    earlier = read_out(out)
    for target in (out, out.parent):  # files go into `out` (GGUF) or beside it, renamed into place (hf)
        _check_writable(out, target)
    return earlier


def _check_writable(out: Path, target: Path) -> None:
    """Refuse an `--out` whose folder `target` (or the folder it would be made in) this user cannot write,
    or that has a file in the way, before anything is loaded."""
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    code = errno.ENOTDIR if not existing.is_dir() else None
    if code is None and not os.access(existing, os.W_OK | os.X_OK):
        code = errno.EACCES
    if code is not None:
        raise unwritable_out(out, OSError(code, os.strerror(code), str(existing)))


def unwritable_out(out: Path, exc: OSError) -> ConfigError:
    """`--out` cannot be made or written into (no permission, a file in the way, a read-only filesystem),
    as one paragraph: the folder, the errno and the fix."""
    folder = exc.filename or out.parent
    return ConfigError(
        [
            f"--out {out}: {folder} cannot be written ([Errno {exc.errno}] {exc.strerror}); nothing was "
            "exported; choose an --out under a folder you can write (e.g. in your home folder), or fix that "
            "folder's permissions"
        ]
    )


def replace_folder(tmp: Path, out: Path) -> None:
    """`tmp` (a complete export) takes the name `out`. The earlier export there is checked again (a file
    added while this one was written is refused the same way, and `tmp` is left to the caller), renamed
    aside, and only its own files are deleted once the new one is in place."""
    earlier = read_out(out)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old.exists():
            old.rename(out)  # the earlier export back under its name
        raise
    if old.exists():
        _remove_earlier(old, earlier.files)


def _remove_earlier(old: Path, files: tuple[str, ...]) -> None:
    """Delete the earlier export's own `files` from `old` (its folder, renamed aside), then the folders
    that leaves empty; anything that appeared there meanwhile is kept, and said."""
    for rel in files:
        if _is_plain_file(old / rel):
            (old / rel).unlink()
    folders = {p for rel in files for p in (old / rel).parents if old in p.parents}
    for folder in [*sorted(folders, key=lambda p: len(p.parts), reverse=True), old]:  # deepest first
        with contextlib.suppress(OSError):  # not empty: something appeared there meanwhile (said below)
            folder.rmdir()
    if old.exists():
        warn(
            f"{old} was kept: files appeared in the earlier export while this one was written; look through it"
        )
