"""Every command of README.md that can run on a CPU machine runs, as written.

The rule, for whoever edits the README: every ```bash block is run, top to bottom, each block as one bash
script (`set -euo pipefail`), all in one scratch folder that links the repository's configs/, data/,
ds_configs/ and launchers/ (so a later block can use the runs/ an earlier one made). A command that cannot
run on a CPU test machine says so in a trailing comment, `# needs: <what>` (the weights, a GPU, several
machines, its own .venv, many minutes), and is skipped; every other line runs. Other fences (```text
output, ```python, ```yaml) are not run. A block fails the test with its command lines and their output.
Blocks run in README order and a later one may use what an earlier one made (the export section reads the
run of "Using it"), so select them together. The runs keep to a few dozen steps of `tiny-llama`: the cost
is the processes' start-up, and W&B is switched off (`WANDB_MODE=disabled`, which zerofit honours like any
W&B program) because its offline service would double each run's CPU time without testing anything here
(tests/e2e/test_wandb_offline.py tests it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BIN = Path(sys.executable).parent
LINKED = ("configs", "data", "ds_configs", "launchers")
_NEEDS = re.compile(r"#.*\bneeds:\s*(\S.*)?$")


@dataclass(frozen=True)
class Block:
    """One ```bash block: where it is, the commands that run and the ones that say what they need."""

    heading: str
    line: int
    commands: tuple[str, ...]
    skipped: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"L{self.line}-{re.sub(r'[^a-z0-9]+', '-', self.heading.lower()).strip('-')}"


def _logical_lines(lines: list[str]) -> list[str]:
    """Shell lines with `\\` continuations joined."""
    out: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return [line for line in out if line.strip() and not line.lstrip().startswith("#")]


def readme_blocks(text: str) -> list[Block]:
    """Every ```bash block of `text`, its lines split into runnable commands and `# needs:` ones."""
    blocks: list[Block] = []
    heading, body, start, other_fence = "top", None, 0, False
    for number, line in enumerate(text.splitlines(), start=1):
        if other_fence:  # inside a ```text / ```python block: a `#` line there is no heading
            other_fence = line.strip() != "```"
        elif body is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            elif line.strip() == "```bash":
                body, start = [], number
            elif line.strip().startswith("```"):
                other_fence = True
        elif line.strip() == "```":
            commands = _logical_lines(body)
            skipped = tuple(c for c in commands if _NEEDS.search(c))
            blocks.append(Block(heading, start, tuple(c for c in commands if c not in skipped), skipped))
            body = None
        else:
            body.append(line)
    return blocks


BLOCKS = readme_blocks(README.read_text())


def test_the_readme_has_commands_that_run() -> None:
    # The parser found the blocks (a broken parser would make the test below vacuous).
    assert len(BLOCKS) >= 5
    assert sum(len(b.commands) for b in BLOCKS) >= 10


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_skipped_commands_say_what_they_need(block: Block) -> None:
    for command in block.skipped:
        match = _NEEDS.search(command)
        assert match and match.group(1), f"README.md:{block.line}: '# needs:' without a reason: {command}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("readme")
    for name in LINKED:
        (folder / name).symlink_to(REPO / name)
    return folder


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.commands], ids=lambda b: b.id)
def test_readme_block_runs(block: Block, scratch: Path) -> None:
    script = "set -euo pipefail\n" + "\n".join(block.commands) + "\n"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        ["bash", "-c", script], cwd=scratch, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, (
        f"README.md:{block.line} ({block.heading}) failed with exit code {proc.returncode}:\n{script}\n"
        f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
