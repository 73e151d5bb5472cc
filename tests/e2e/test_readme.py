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

Each block runs as the README says a new shell must: with `.venv` activated (`source .venv/bin/activate`, the
scratch folder's `.venv` being the test's own virtual environment) and nothing of it on PATH before. The
README's activation block itself runs without that first line, from a PATH without the venv: its
`zerofit --help` proves that activating is what puts the command on PATH.

Shown outputs are checked, not only exit codes (tests/doc_blocks.py reads them): a ```text block right
below a ```bash block (nothing but blank lines between) is that block's output, and a ```text (or plain)
block whose first line is `$ command` is that command's, run in the same scratch folder after every block
(unless it says `# needs:`). Each shown line must start a line of the real output (stdout and stderr), in
the shown order; `...` stands for any lines. Compared with blanks collapsed and table rules shortened to one
character, and with timings, speeds and measured memory masked (tok/s, tokens/s, a number of seconds, eta,
a step line's peak; every number of a table row about wall time, tokens/s, peak memory or cpu_rss): those
differ from run to run (tests/doc_blocks.py, `VOLATILE`), and without the plan's `; from the tokenization
cache` (it says whether an earlier run filled the cache). A plan's GiB, a loss and a count are compared as
shown, except where the fence states a tolerance (```text ±0.01): then each decimal figure may be that far
from the shown one. A training run in bf16 or fp16 must state one (its figures depend on the CPU's or GPU's
kernels: the 4th decimal of a loss differs between AVX2, AVX512 and AVX512-BF16 CPUs), and fails here if its
shown output compares a decimal figure exactly. The commands run with COLUMNS=200, so a plan's lines are not
wrapped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import (
    NEEDS,
    REPO,
    Block,
    Shown,
    all_blocks,
    all_shown_commands,
    exact_half_precision_figures,
    missing_shown,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BIN = Path(sys.executable).parent
VENV = Path(sys.prefix)
LINKED = ("configs", "data", "ds_configs", "launchers")
BLOCKS = all_blocks()
SHOWN = all_shown_commands()
ACTIVATE = "source .venv/bin/activate"


def test_the_readme_says_how_to_get_the_command() -> None:
    # After `make demo`, a new shell has no `zerofit` on PATH: the README's quick start says how to get it,
    # in a block that runs from a fresh shell and calls the command.
    quick = [b for b in BLOCKS if b.doc == "README.md" and b.heading.startswith("Quick start")]
    assert any(
        b.commands and b.commands[0].startswith(ACTIVATE) and "zerofit --help" in b.commands for b in quick
    )


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
    assert (VENV / "bin" / "activate").is_file(), (
        f"the README's blocks run from a virtual environment ({VENV})"
    )
    folder = tmp_path_factory.mktemp("readme")
    for name in LINKED:
        (folder / name).symlink_to(REPO / name)
    (folder / ".venv").symlink_to(VENV)
    return folder


def _fresh_shell_env() -> dict[str, str]:
    """A new shell's environment: nothing of the venv on PATH, no launcher variables, W&B off."""
    path = [
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != BIN.resolve()
    ]
    env = {**os.environ, "PATH": os.pathsep.join(path), "WANDB_MODE": "disabled", "COLUMNS": "200"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VIRTUAL_ENV"):
        env.pop(key, None)
    return env


def _run(commands: tuple[str, ...], scratch: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    """Run `commands` as one bash script in a new shell that activates .venv first (unless they do)."""
    activate = () if commands and commands[0].startswith(ACTIVATE) else (ACTIVATE,)
    script = "set -euo pipefail\n" + "\n".join((*activate, *commands)) + "\n"
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=scratch,
        env=_fresh_shell_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return script, proc


def _check_shown(shown: Shown, script: str, proc: subprocess.CompletedProcess[str]) -> None:
    output = proc.stdout + "\n" + proc.stderr
    exact = exact_half_precision_figures(shown, output)
    assert not exact, (
        f"{shown.doc}:{shown.line}: the command trains in bf16 or fp16, whose figures depend on the machine's "
        f"kernels, but its shown output compares them exactly ({exact[0]!r}): state a tolerance on the fence, "
        "```text ±0.01 (docs/contracts.md, Shown outputs)"
    )
    missing = missing_shown(shown.lines, output, shown.tolerance)
    assert missing is None, (
        f"{shown.doc}:{shown.line}: the shown output is not what the command prints today; first differing "
        f"line (as compared): {missing!r}\n{script}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
        f"--- stderr ---\n{proc.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.commands], ids=lambda b: b.id)
def test_readme_block_runs(block: Block, scratch: Path) -> None:
    script, proc = _run(block.commands, scratch)
    assert proc.returncode == 0, (
        f"{block.doc}:{block.line} ({block.heading}) failed with exit code {proc.returncode}:\n{script}\n"
        f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
    if block.shown is not None:
        _check_shown(block.shown, script, proc)


@pytest.mark.parametrize("shown", [s for s in SHOWN if not NEEDS.search(s.command or "")], ids=lambda s: s.id)
def test_shown_output_is_todays(shown: Shown, scratch: Path) -> None:
    # After the blocks above (they may have made what the command reads): the command prints what is shown.
    script, proc = _run((shown.command or "",), scratch)
    _check_shown(shown, script, proc)
