"""`zerofit generate RUN_DIR|EXPORT_DIR|MODEL --prompt TEXT`: print a model's continuation of a prompt.

A smoke check after training, and the base model's side of a before/after comparison: a run or an export
encodes the prompt as its training encoded prompts (the chat template when the run trained on
`data.format: messages`); a model as `model.name_or_path` takes it (a built-in name such as
smollm2-135m-instruct, a hub id, a local Hugging Face folder) gets its tokenizer's chat template when it has
one. Decoding is greedy unless `--temperature` is given, and only the new text is printed on stdout. See
`zerofit.trained.generate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from zerofit.commands.export import add_step_flag, add_trust_flags
from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries, warn


def register(subparsers: Any) -> None:
    """Add the `generate` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="sample from a trained run, an export or a model (a smoke check)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "path",
        metavar="RUN_DIR|EXPORT_DIR|MODEL",
        help="a run directory, a `zerofit export` folder, or a model as model.name_or_path takes it (a built-in "
        "name such as smollm2-135m-instruct, a hub id, a local Hugging Face folder)",
    )
    parser.add_argument(
        "--prompt", required=True, help="the prompt text (use $'...\\n' in bash for a newline)"
    )
    parser.add_argument(
        "--image",
        type=Path,
        default=None,
        metavar="PATH",
        help="an image shown before the prompt, as one user turn (a vision-language model)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="at most N new tokens (default 64)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sample at temperature T (default 0: greedy)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling (with --temperature)")
    add_step_flag(parser)
    add_trust_flags(parser)
    parser.set_defaults(func=run)


def check_sampling(max_new_tokens: int, temperature: float) -> None:
    """Refuse a length or temperature generation cannot take (`zerofit generate`, the studio's chat)."""
    from zerofit.core.errors import ConfigError

    if max_new_tokens < 1:
        raise ConfigError([f"--max-new-tokens {max_new_tokens}: must be >= 1"])
    if temperature < 0:
        raise ConfigError([f"--temperature {temperature}: must be >= 0 (0 = greedy)"])


def run(args: argparse.Namespace) -> int:
    """Load, generate, print the completion."""
    check_sampling(args.max_new_tokens, args.temperature)
    quiet_deepspeed_on_cpu()
    quiet_libraries()
    from zerofit.checkpoint.policy import resolve_step
    from zerofit.trained.generate import load_generator

    step = resolve_step(Path(args.path), args.step) if args.step is not None else None
    generator = load_generator(
        args.path,
        step=step,
        trust_pickles=args.trust_pickles,
        trust_remote_code=args.trust_remote_code,
    )
    text = generator(args.prompt, args.max_new_tokens, args.temperature, args.seed, args.image)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()
    if not text.strip():
        warn(
            "the continuation is empty: the model's first new token ended the sequence (an undertrained model "
            "often does); try --temperature 0.8 to sample past it"
        )
    return 0
