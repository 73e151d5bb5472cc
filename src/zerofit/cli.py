"""`zerofit` command line: plan | presets | compare | export.

Each subcommand lives in `zerofit.commands.<name>` and exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. This module only dispatches and turns user errors into one clear
paragraph with a non-zero exit code (no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from zerofit.errors import ZerofitError

# Subcommand modules, in help order. A module that is not there yet is simply not offered.
COMMANDS = ("plan", "presets", "compare", "export")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="zerofit", description="Fine-tune 7B LLMs on small GPUs with one exact global batch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"zerofit.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"zerofit.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zerofit` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ZerofitError as exc:
        print(f"zerofit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `zerofit presets --json | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
