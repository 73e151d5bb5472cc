"""`zerofit score RUN_DIR|EXPORT_DIR --prompt TEXT --response TEXT`: print a reward model's scalar reward.

For a run trained with `train.objective: reward` (or its merged export): the response is encoded as training
encoded a pair's chosen answer to the prompt (`--chat`: as a user turn and an assistant turn through the chat
template, as conversational pairs train), and the score head's output is printed on stdout, one number
(higher: preferred). See `zerofit.trained.score`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from zerofit.commands.export import add_step_flag, add_trust_flags
from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries


def register(subparsers: Any) -> None:
    """Add the `score` subcommand."""
    parser = subparsers.add_parser(
        "score",
        help="a reward model's reward for a prompt and a response",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "path",
        metavar="RUN_DIR|EXPORT_DIR",
        help="a reward run's directory or its `zerofit export --merge` folder",
    )
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--response", required=True, help="the response text to score")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user turn and the response an assistant turn (the chat template), as conversational "
        "pairs train",
    )
    add_step_flag(parser)
    add_trust_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the reward model, score the pair, print the reward."""
    quiet_deepspeed_on_cpu()
    quiet_libraries()
    from zerofit.checkpoint.policy import resolve_step
    from zerofit.trained.score import load_scorer

    step = resolve_step(Path(args.path), args.step) if args.step is not None else None
    scorer = load_scorer(
        Path(args.path), step=step, trust_pickles=args.trust_pickles, trust_remote_code=args.trust_remote_code
    )
    sys.stdout.write(f"{scorer(args.prompt, args.response, args.chat):.6f}\n")
    sys.stdout.flush()
    return 0
