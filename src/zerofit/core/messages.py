"""What zerofit says to its user, and the one way it says it.

- `say`: progress and results, one line on stdout, from rank 0 only (every rank may call it);
- `warn`: something the user should know but need not stop for, one line on stderr;
- `error`: a `ZerofitError` (or any user error) as one paragraph on stderr, never a traceback;
- `quiet_libraries`: silence library chatter that would bury those lines;
- `line_buffered_output`: every line reaches a log file as it is written (nohup, SLURM, `> log`).

The training loop's per-step progress and tables are the console sink's (`zerofit.metrics.console`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

__all__ = ["error", "line_buffered_output", "quiet_for", "quiet_libraries", "said", "say", "warn"]

_last_line = [time.monotonic()]  # when this process last printed a line for its user


def said() -> None:
    """Record that a line for the user was printed just now (`say` and `warn` do; so does a printer of its
    own, the console sink's step lines): a progress line is due only after `every_s` of quiet."""
    _last_line[0] = time.monotonic()


def quiet_for() -> float:
    """Seconds since this process last printed a line for its user (`said`)."""
    return time.monotonic() - _last_line[0]


def say(message: str, *, rank: int = 0) -> None:
    """Print `message` on stdout once per run: on rank 0, silently nowhere else. One write of the line and
    its newline: a progress line from another thread (`zerofit.core.progress`) never splits it."""
    if rank == 0:
        sys.stdout.write(f"{message}\n")
        sys.stdout.flush()
        said()


def warn(message: str) -> None:
    """Print one warning line on stderr (every rank that calls it)."""
    print(f"zerofit: warning: {message}", file=sys.stderr, flush=True)
    said()


def error(source: str, exc: BaseException | str) -> None:
    """Print a user error as `<source>: error: <paragraph>` on stderr; the caller exits non-zero.

    One write of the whole paragraph: every rank reports the same error, and a paragraph written line by
    line would interleave with the other ranks' copies (launchers merge the ranks' output).
    """
    text = f"{source}: error: {exc}\n"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError, AttributeError):  # a stream without a file descriptor (captured output)
        print(text, end="", file=sys.stderr, flush=True)


def line_buffered_output() -> None:
    """Make this process's stdout and stderr line-buffered, as on a terminal, also when they are a file.

    Python block-buffers a stdout that is a file or a pipe: under nohup, SLURM or `> log` a line printed
    without a flush (a library's, or a rank's) would appear only when 8 KiB have gathered, or at exit. For
    a launched run, not for the in-process API (the caller's streams are the caller's).
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # absent on a replaced stream (pytest capture)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def quiet_deepspeed_on_cpu() -> None:
    """On a machine without CUDA, name the CPU as DeepSpeed's accelerator (what it would detect anyway).

    For the commands that only read weights on the host (`zerofit export`, `zerofit generate`): DeepSpeed,
    imported on the way by peft / transformers / zero_to_fp32, otherwise warns that it fell back to the CPU.
    An accelerator the user chose (`DS_ACCELERATOR`) is kept.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def quiet_libraries() -> None:
    """Silence library chatter that would bury the plan and the progress line (errors still show)."""
    # bitsandbytes warns at import that an optional CPU kernel package is missing; it is not needed.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from zerofit.core.transformers_import import import_transformers

    transformers = import_transformers()  # the first import of a launch: its model index read once

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # Deprecations inside transformers/DeepSpeed internals that users cannot act on.
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r".*(is_gradient_checkpointing|all_gather_into_tensor|reduce_scatter_tensor).*",
    )
    # FSDP's sharded grad scaler (fp16) keeps a 1-element found-inf tensor that DTensor warns about.
    warnings.filterwarnings("ignore", category=UserWarning, message=r"Found a non-scalar tensor with numel=1")
