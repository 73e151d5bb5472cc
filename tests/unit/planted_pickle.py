"""A pickle planted where zerofit loads weights: the file a test expects zerofit to refuse unread."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def plant_pickle(path: Path, ran: Path) -> None:
    """A torch pickle at `path` that would create folder `ran` if it were ever unpickled (with
    weights_only=False; torch's weights-only load refuses it with a traceback)."""

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.mkdir, (str(ran),)

    torch.save({"weight": Payload()}, path)
