"""Every command of README.md and of the guides (docs/guides/) that can run on a CPU machine runs, as written.

The rule, for whoever edits the README or a guide: every ```bash block is run, top to bottom, each block as
one bash script (`set -euo pipefail`), all in one scratch folder that links the repository's configs/, data/,
ds_configs/ and launchers/ (so a later block can use the runs/ an earlier one made). A command that cannot
run on a CPU test machine says so in a trailing comment, `# needs: <what>` (the weights, a GPU, several
machines, its own .venv, many minutes), and is skipped; every other line runs. Other fences (```text
output, ```python, ```yaml) are not run. A block fails the test with its document, line, command lines and
their output. Blocks run in order, the README's first and then each guide's as docs/guides/README.md lists
the guides (tests/doc_blocks.py), and a later one may use what an earlier one made (the export guide reads
the run of the README's tour), so select them together. The runs keep to a few dozen steps of `tiny-llama`:
the cost is the processes' start-up, and W&B is switched off (`WANDB_MODE=disabled`, which zerofit honours
like any W&B program) because its offline service would double each run's CPU time without testing anything
here (tests/e2e/test_wandb_offline.py tests it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import NEEDS, REPO, Block, all_blocks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BIN = Path(sys.executable).parent
LINKED = ("configs", "data", "ds_configs", "launchers")
BLOCKS = all_blocks()


def test_the_readme_has_commands_that_run() -> None:
    # The parser found the blocks (a broken parser would make the test below vacuous).
    assert len(BLOCKS) >= 5
    assert sum(len(b.commands) for b in BLOCKS) >= 10


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_skipped_commands_say_what_they_need(block: Block) -> None:
    for command in block.skipped:
        match = NEEDS.search(command)
        assert match and match.group(1), f"{block.doc}:{block.line}: '# needs:' without a reason: {command}"


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
        f"{block.doc}:{block.line} ({block.heading}) failed with exit code {proc.returncode}:\n{script}\n"
        f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
