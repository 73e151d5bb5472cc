"""User-facing errors: one paragraph that names the field, the value, the rule and a fix; never a traceback."""

from __future__ import annotations


class ZerofitError(Exception):
    """Base class for every error caused by user input (config, data, launch environment).

    Entry points catch it, print `str(err)` as one paragraph and exit non-zero without a traceback.
    Anything else is a bug in zerofit and keeps its traceback.

    `agreed` (class attribute): every rank raises this error from the same agreed values (an all-reduce),
    so the launcher prints it once, on rank 0, instead of once per rank.
    """

    agreed: bool = False


class ConfigError(ZerofitError):
    """The configuration is invalid; the message lists every problem found, not only the first."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            msg = f"Invalid configuration: {self.problems[0]}"
        else:
            msg = f"Invalid configuration ({len(self.problems)} problems):\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(msg)

    def without_heading(self) -> str:
        """The problems alone, for a command whose input is not a config file (`zerofit export` /
        `generate`: its flags and a run folder), where "Invalid configuration" would point the user at
        a config they never wrote."""
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)


class DataError(ZerofitError):
    """The training data cannot be used; the message names the file and line."""


class LaunchError(ZerofitError):
    """The launch environment does not match the request (world size, device, launcher)."""


class ResumeError(ZerofitError):
    """The run cannot resume as asked: nothing to resume, no checkpoint that verifies, or a changed config
    that would alter the training trajectory."""


class CheckpointWriteError(ZerofitError):
    """A checkpoint could not be written (a full disk, a quota, a read-only filesystem): every rank reports
    the same paragraph, naming the folder, its free space, the checkpoint kept and the fix."""


class MetricsWriteError(ZerofitError):
    """The run's metrics (metrics.jsonl, run_info.json, summary.json) could not be written (a full disk):
    the run stops after that step on every rank, with the same paragraph naming the file, its filesystem's
    free space, the checkpoint kept and the fix."""


class ExportWriteError(ZerofitError):
    """The final export could not be written (a full disk): every rank reports the same paragraph, naming
    the folder, its free space and the checkpoint the weights can be exported from."""


class RunFinished(ResumeError):
    """A resume found the run already finished (its last step done, or stopped early by its patience): one
    paragraph saying so and how to train further; nothing is trained or written. Under
    `checkpoint.resume=auto` (a scheduler's requeue) the launch exits 0, so the requeued job neither fails
    nor changes anything."""


class TrainingDiverged(ZerofitError):
    """A step's loss or gradient norm is not finite (NaN or inf): the run stops at that step on every rank
    with one paragraph naming the step, the value and the likely causes; nothing from that step is saved, so
    the last checkpoint stays the last good one."""

    agreed = True


class PeerLost(ZerofitError):
    """Another rank of the run stopped (killed, out of memory, a crash) or the connection to it was lost, so
    this rank cannot go on: every rank left says so in one paragraph naming that rank (where it can be seen
    from this host), the last complete checkpoint and the resume command, with the exit code
    `zerofit.recipe.lost_rank.EXIT_PEER_LOST` instead of a collective's traceback."""


class RewardError(ZerofitError):
    """A reward function failed on a step's completions (it raised, returned the wrong count of scores, or a
    NaN / infinite / non-numeric score): one paragraph naming the function, the step and the data row, so the
    run stops there and its last good checkpoint stays the last one written."""
