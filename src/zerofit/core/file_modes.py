"""Files zerofit writes take the mode the umask gives, like every file `open()` creates.

safetensors (0.8) writes its file through a private temporary file of mode 0600 that it renames into
place, so `model.safetensors`, `adapter_model.safetensors` and the cached tables would be readable by their
owner only while the `config.json` beside them follows the umask: on the shared filesystem a multi-node
run writes to, teammates could read everything of an export but its weights. `follow_umask` is called on
every folder or file zerofit writes through such a library (the model folders of `save_pretrained_here`,
`zerofit export`'s folder, the built-in models' cache, the reference table) before it is renamed into
place.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["follow_umask", "umask_file_mode"]


def _umask() -> int:
    """This process's umask: read from /proc on Linux (nothing changes); elsewhere set and put back at once
    (the only portable way to read it: a file another thread creates in between gets 0o022's mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_file_mode() -> int:
    """The mode a new file gets from `open()` under this process's umask: 0o666 without the umask's bits."""
    return 0o666 & ~_umask()


def follow_umask(path: str | Path) -> None:
    """Give the file `path`, or every regular file under the folder `path`, the umask's mode
    (`umask_file_mode`): they are data (weights, JSON, tokenizer files), never programs. Links are left alone."""
    mode = umask_file_mode()
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    for file in files:
        if stat.S_IMODE(file.lstat().st_mode) != mode:
            os.chmod(file, mode)
