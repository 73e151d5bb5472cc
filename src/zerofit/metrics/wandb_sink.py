"""The Weights & Biases sink: comparable runs by default, and never a failed run for lack of network.

- Mode comes resolved (`online` when an API key is configured, else `offline`); `disabled` never gets here.
  An online init that fails or times out falls back to offline with a one-line notice; an offline init
  that fails too leaves the run logging to `metrics.jsonl` only. The API key is never read, printed or
  logged by zerofit: wandb finds it itself.
- Defaults make comparison easy: group = the experiment (the config file's stem, or the run name without
  its split suffix), name = preset + split, so runs of one job over several presets/splits sit together.
- Files go under the run directory (`run_dir/wandb/`). A resumed run continues the same W&B run id.
- The optimizer step (`train/step`) is the x-axis of every metric; `train/tokens_seen` is a second x-axis.
- Logged names equal the `metrics.jsonl` keys, so the two can be compared one to one. Tables (`log_table`:
  GRPO's sampled completions, the rows of `completions.jsonl`) are logged at their step as `wandb.Table`s.
- Under the `deepspeed` launcher (`outlive_launcher`), W&B's service is started outside the rank's process
  tree (`detached_service_token`): on Ctrl-C or SIGTERM, DeepSpeed's `launch.py` terminates every
  descendant of each rank at once, which killed W&B's service mid-run (`W&B stopped logging:
  ConnectionResetError`) while the rank went on to save its stop checkpoint. Started apart, the service
  keeps logging until the rank finishes the run's W&B file and disconnects; it then exits when idle.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import string
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerofit.config.rules.training import wandb_key_configured
from zerofit.core.messages import say
from zerofit.core.run_layout import RunLayout
from zerofit.engine_spec.run_plan import RunPlan
from zerofit.metrics.base import NOT_NUMERIC, plottable
from zerofit.metrics.summary import (
    RunSummary,
    next_tokens_seen,
    predicted_peak_gib,
    tokens_seen_through,
)

STEP_METRIC = "train/step"
TOKENS_METRIC = "train/tokens_seen"
# Seconds wandb may take to start (and to upload at the end, online) before we give up on it.
INIT_TIMEOUT_S = 30.0
FINISH_TIMEOUT_S = 120.0

# wandb's variable naming a running service to connect to instead of starting one.
SERVICE_ENV = "WANDB_SERVICE"
# How long a service started apart from the run waits, idle after the run disconnected, before it exits.
DETACHED_IDLE = "60s"

# The batch suffix of a default run name (see `default_run_name`): "-g16" (earlier names: "-g16-m2x4x2").
_SPLIT_SUFFIX = re.compile(r"-g\d+(-m\d+x\d+x\d+)?$")


def split_label(plan: RunPlan) -> str:
    """The batch split as `g{global}-m{micro}x{gas}x{dp}` (the same spelling as default run names)."""
    p = plan.batch
    return f"g{p.global_batch_size}-m{p.micro_batch_size}x{p.grad_accum_steps}x{p.dp_size}"


def default_group(plan: RunPlan, config_path: str | Path | None = None) -> str:
    """The experiment a run belongs to: the config file's stem if known, else the run name minus its split.

    A run name without a split suffix (user-chosen) is used whole.
    """
    if config_path:
        return Path(config_path).stem
    run_name = plan.config.run_name or "zerofit"
    return _SPLIT_SUFFIX.sub("", run_name)


def default_name(plan: RunPlan) -> str:
    """Preset (or strategy) + split: what distinguishes runs inside one comparison group."""
    cfg = plan.config
    engine = cfg.distributed.preset or cfg.distributed.strategy
    return f"{engine}-{split_label(plan)}"


class WandbSink:
    """Logs to a wandb run (online or offline); see the module docstring for the rules it keeps."""

    def __init__(
        self,
        plan: RunPlan,
        *,
        config_path: str | Path | None = None,
        notice: Callable[[str], None] = say,
        init_timeout: float = INIT_TIMEOUT_S,
        key_configured: bool | None = None,
        resume: bool = False,
        outlive_launcher: bool = False,
    ) -> None:
        wb = plan.config.logging.wandb
        self._notice = notice
        self._own_service_env = False
        self._summary = RunSummary()
        self._start = time.monotonic()
        self._tokens_seen = 0.0
        self._strings: dict[str, str] = {}
        self.run: Any = None
        self.mode = wb.mode or "offline"
        if self.mode == "disabled":
            return
        self.dir = plan.run_dir
        self.layout = RunLayout(self.dir)  # wandb/ and its run-id file
        self.init_kwargs: dict[str, Any] = {
            "project": wb.project,
            "entity": wb.entity,
            "group": wb.group or default_group(plan, config_path),
            "name": wb.name or default_name(plan),
            "tags": list(wb.tags),
            "dir": str(self.dir),
            "job_type": "train",
            "reinit": "finish_previous",
            **self._run_id(resume),
        }
        if key_configured is None:
            key_configured = wandb_key_configured()
        if self.mode == "offline" and not key_configured:
            notice(
                "zerofit: W&B logging offline (no API key in WANDB_API_KEY or ~/.netrc); files in "
                f"{self.layout.wandb}, upload later with `wandb sync {self.layout.wandb}/offline-run-*`"
            )
        if outlive_launcher and SERVICE_ENV not in os.environ:
            token = detached_service_token(init_timeout)
            if token is not None:  # else wandb starts its own, as a child of this rank
                os.environ[SERVICE_ENV], self._own_service_env = token, True
        self.run = self._init(self.mode, init_timeout)
        if self.run is None and self.mode == "online":
            notice("zerofit: W&B online init failed (network or key); falling back to offline logging")
            self.mode = "offline"
            self.run = self._init("offline", init_timeout)
        if self.run is None:
            notice("zerofit: W&B could not start; this run logs to metrics.jsonl only")
            return
        self._log_write_failed = False
        _quiet_log_write_errors(self._on_log_write_error)
        # The optimizer step is the x-axis of everything; tokens seen is the other useful axis.
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric(TOKENS_METRIC, step_metric=STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def _run_id(self, resume: bool) -> dict[str, Any]:
        """The W&B run id: a resumed run continues the id its run directory recorded (`resume="allow"`);
        a new run gets a fresh id, recorded in `wandb/zerofit-run-id` for its resumes."""
        id_file = self.layout.wandb_run_id
        if resume and id_file.is_file() and id_file.read_text().strip():
            return {"id": id_file.read_text().strip(), "resume": "allow"}
        run_id = "".join(
            secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)
        )  # W&B's style
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        return {"id": run_id}

    def resume_from(self, rows: list[dict[str, Any]], wall_s: float) -> None:
        """A resumed run: the earlier steps count in the summary and in `train/tokens_seen`."""
        self._summary.replay(rows)
        self._start -= wall_s
        self._tokens_seen = tokens_seen_through(rows)

    def _init(self, mode: str, timeout: float) -> Any:
        try:
            import wandb

            self.dir.mkdir(parents=True, exist_ok=True)
            settings = wandb.Settings(
                init_timeout=timeout,
                finish_timeout=FINISH_TIMEOUT_S,
                console="off",  # the console sink owns stdout; don't capture or rewrap it
                silent=True,
            )
            return wandb.init(mode=mode, settings=settings, **self.init_kwargs)
        except Exception as exc:  # no network, bad key, broken install: never fail the training run
            self._notice(f"zerofit: W&B {mode} init failed: {type(exc).__name__}: {_first_line(exc)}")
            return None

    def _on_log_write_error(self, exc: BaseException | None) -> None:
        if not self._log_write_failed:  # one line, not one per record
            self._log_write_failed = True
            why = f": {type(exc).__name__}: {_first_line(exc)}" if exc is not None else ""
            self._notice(f"zerofit: W&B could not write its log file in {self.layout.wandb}{why}")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.run is None:
            return
        self._summary.update(step, metrics)
        self._tokens_seen = next_tokens_seen(self._tokens_seen, metrics)
        row: dict[str, Any] = {STEP_METRIC: step, TOKENS_METRIC: self._tokens_seen}
        try:
            for key, value in metrics.items():
                if key == "step":
                    continue
                converted = plottable(value)
                if converted is NOT_NUMERIC:
                    # Labels such as mem/source are constant per run: summary, not a plotted series.
                    if self._strings.get(key) != str(value):
                        self._strings[key] = str(value)
                        self.run.summary[key] = str(value)
                elif converted is not None:
                    row[key] = converted
            self.run.log(row, step=step)
        except Exception as exc:  # W&B's service is gone (e.g. a launcher terminated the process tree)
            self._notice(f"zerofit: W&B stopped logging: {type(exc).__name__}: {_first_line(exc)}")
            self.run = None

    def log_table(self, step: int, key: str, rows: list[dict[str, Any]]) -> None:
        """`rows` as a `wandb.Table` under `key` at `step` (its columns: the first row's keys), in the same
        history row as the step's metrics; a failure stops W&B logging as `log`'s does."""
        if self.run is None or not rows:
            return
        try:
            import wandb

            columns = list(rows[0])
            table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
            self.run.log({STEP_METRIC: step, key: table}, step=step)
        except Exception as exc:  # as in `log`: W&B's service is gone
            self._notice(f"zerofit: W&B stopped logging: {type(exc).__name__}: {_first_line(exc)}")
            self.run = None

    def log_config(self, config: dict[str, Any]) -> None:
        if self.run is None:
            return
        self._summary.predicted_peak = predicted_peak_gib(config)
        self.run.config.update(config, allow_val_change=True)

    def close(self) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            for key, value in self._summary.result(time.monotonic() - self._start).items():
                if value is not None:
                    run.summary[f"summary/{key}"] = value
            run.finish()
            # wandb 0.31's core process writes the run file asynchronously: after finish() the offline
            # file can still hold only its header. teardown() waits for the service to flush and stop,
            # so the file is complete when close() returns (readers, `zerofit compare`, a killed job).
            import wandb

            wandb.teardown()
        except Exception as exc:  # a failed upload at the end must not turn a finished run into a failure
            self._notice(f"zerofit: W&B finish failed: {type(exc).__name__}: {_first_line(exc)}")
        finally:
            if self._own_service_env:  # the service exits by itself once idle (DETACHED_IDLE)
                os.environ.pop(SERVICE_ENV, None)


def detached_service_token(timeout: float) -> str | None:
    """Start a W&B service that is no descendant of this process (wandb's `wandb beta core start`: the
    service outlives the short-lived command, so its parent becomes init) and return its connection token,
    or None when it cannot be started (an old wandb without the command, a timeout)."""
    command = [sys.executable, "-m", "wandb", "beta", "core", "start", "--idle-timeout", DETACHED_IDLE]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1].strip() if lines and "-" in lines[-1] else None


def _quiet_log_write_errors(report: Callable[[BaseException | None], None]) -> None:
    """A failed write of wandb's own log file (`wandb/debug.log`, on a full disk) calls `report` with the
    error instead of printing Python logging's `--- Logging error ---` traceback for every record after it."""
    for handler in logging.getLogger("wandb").handlers:
        if isinstance(handler, logging.FileHandler):
            # logging calls handleError inside its `except`: the error is the one being handled.
            handler.handleError = lambda record: report(sys.exc_info()[1])  # type: ignore[method-assign]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
