"""`zerofit` command line: plan | presets | compare | export | generate | score | eval | studio.

Each subcommand lives in `zerofit.commands.<name>` (the studio's in `zerofit.studio.command`, beside the
app it serves, which calls the commands' own code) and exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. This module only dispatches and turns user errors into one clear
paragraph with a non-zero exit code (no traceback).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from zerofit.commands import compare, export, generate, plan, presets, score
from zerofit.commands import eval as eval_command
from zerofit.core.errors import ConfigError, ZerofitError
from zerofit.core.messages import error
from zerofit.studio import command as studio

# Subcommands, in help order.
COMMANDS = (plan, presets, compare, export, generate, score, eval_command, studio)
# The commands whose input is a run config (file and overrides): their ConfigErrors say "Invalid configuration".
CONFIG_COMMANDS = ("plan", "presets", "compare")

_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")  # dotted.key=value


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="zerofit", description="Fine-tune 7B LLMs on small GPUs with one exact global batch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse `argv`, with a subcommand's `key=value` overrides allowed before, between and after its flags.

    argparse fills a `nargs="*"` positional from one run of arguments only, and `parse_intermixed_args`
    refuses parsers with subcommands; so the overrides argparse leaves over (`plan --config X a=1 --json
    b=2` leaves `b=2`) are appended, in order, to the command's own `overrides`.
    """
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all(_OVERRIDE.match(item) for item in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zerofit` console script."""
    args = parse_args(build_parser(), argv)
    try:
        return int(args.func(args) or 0)
    except ZerofitError as exc:
        # `export` and `generate` read flags and a run folder: their problems are theirs, not a config's.
        own = isinstance(exc, ConfigError) and args.command not in CONFIG_COMMANDS
        error(
            f"zerofit {args.command}", exc.without_heading() if isinstance(exc, ConfigError) and own else exc
        )
        return 2
    except BrokenPipeError:
        # `zerofit presets --json | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
