"""`zerofit` command line: plan | presets | compare.

Each subcommand lives in `zerofit.commands.<name>` and exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. This module only dispatches and turns user errors into one clear
paragraph with a non-zero exit code (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zerofit.commands import compare, plan, presets
from zerofit.errors import ZerofitError
from zerofit.messages import error

# Subcommands, in help order.
COMMANDS = (plan, presets, compare)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="zerofit", description="Fine-tune 7B LLMs on small GPUs with one exact global batch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zerofit` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ZerofitError as exc:
        error(f"zerofit {args.command}", exc)
        return 2
    except BrokenPipeError:
        # `zerofit presets --json | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
