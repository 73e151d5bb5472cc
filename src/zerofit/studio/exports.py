"""The chat page's export buttons: `zerofit export` itself, in a child process, with one of three fixed flag
sets (never a command the page writes), its output kept as the progress the page shows."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from zerofit.core.errors import ConfigError
from zerofit.studio.security import Workspace

# button -> the flags `zerofit export RUN --out RUN/export-<button>` gets
EXPORT_FLAGS: dict[str, tuple[str, ...]] = {
    "adapter": (),
    "merged": ("--merge",),
    "gguf": ("--format", "gguf"),
}
LOG_TAIL = 4000  # characters of an export's output the page shows


@dataclass
class Export:
    """One export: its run, kind, folder, output so far and exit code (None while it runs)."""

    run: str
    kind: str
    out: str
    output: list[str] = field(default_factory=list)
    returncode: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """What the page shows."""
        return {
            "run": self.run,
            "kind": self.kind,
            "out": self.out,
            "log": "".join(self.output)[-LOG_TAIL:],
            "state": "running" if self.returncode is None else ("done" if self.returncode == 0 else "failed"),
        }


class Exports:
    """The exports this studio started."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.started: list[Export] = []

    def start(self, run: str, kind: str) -> Export:
        """Run `zerofit export RUN --out RUN/export-KIND [flags]` in the background."""
        if kind not in EXPORT_FLAGS:
            raise ConfigError([f"export = {kind!r}: one of {', '.join(EXPORT_FLAGS)}"])
        run_dir = self.workspace.path(run, "run")
        out = run_dir / f"export-{kind}"
        argv = [
            sys.executable,
            "-m",
            "zerofit.cli",
            "export",
            str(run_dir),
            "--out",
            str(out),
            *EXPORT_FLAGS[kind],
        ]
        job = Export(self.workspace.relative(run_dir), kind, self.workspace.relative(out))
        self.started.append(job)
        threading.Thread(target=self._run, args=(job, argv), daemon=True).start()
        return job

    def _run(self, job: Export, argv: list[str]) -> None:
        """The export's process, its output read line by line as it comes."""
        proc = subprocess.Popen(
            argv, cwd=self.workspace.root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            job.output.append(line)
        job.returncode = proc.wait()
