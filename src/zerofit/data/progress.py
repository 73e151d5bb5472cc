"""Progress of tokenizing a source: a rich bar on a terminal; elsewhere (launchers pipe the ranks' output,
CI logs) a line when a large source starts and one when it is done, never control codes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from zerofit.core.messages import say

__all__ = ["LARGE_SOURCE_BYTES", "tokenizing_progress"]

LARGE_SOURCE_BYTES = (
    8 << 20
)  # sources from this size (or row count x 100 bytes) get start/end lines off-terminal


class Tracked(Protocol):
    consumed: int
    total: int
    unit: str

    def describe(self) -> str: ...


@contextmanager
def tokenizing_progress(source: Tracked, enabled: bool) -> Iterator[Callable[[], None]]:
    """Yields `update()`, to call now and then while reading `source` (it reads `source.consumed`)."""
    if not enabled:
        yield lambda: None
        return
    console = Console()
    large = source.total * (1 if source.unit == "B" else 100) >= LARGE_SOURCE_BYTES
    if not console.is_terminal:
        started = time.monotonic()
        if large:
            say(f"tokenizing {source.describe()} ...")
        yield lambda: None
        if large:
            say(f"tokenized {source.describe()} in {time.monotonic() - started:.1f} s")
        return
    amount = DownloadColumn() if source.unit == "B" else MofNCompleteColumn()
    with Progress(
        TextColumn("[bold]tokenizing[/bold] {task.description}"),
        BarColumn(),
        amount,
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(source.describe(), total=max(source.total, 1))
        yield lambda: progress.update(task, completed=source.consumed)
