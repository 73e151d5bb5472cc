"""The MLflow sink (`logging.mlflow`): the rows of `metrics.jsonl` as MLflow metrics of one MLflow run.

- Where: `logging.mlflow.tracking_uri`, else `MLFLOW_TRACKING_URI`, else `sqlite:///<output_dir>/mlflow.db`
  (one store for every run of `output_dir`, artifacts in `<output_dir>/mlartifacts/`; look at it with
  `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`). The URI is never written into the run folder (a
  server's may carry credentials).
- What: every numeric key of a row is a metric of the same name at the row's optimizer step, whatever the key
  (no fixed list); a character MLflow refuses in a name becomes `_` (`metric_name`). A label such as
  `mem/source` is a tag. The resolved config, flattened to dotted keys, is the run's parameters; `config.yaml`,
  the engine file and `run_info.json` are artifacts at the start, `summary.json` (and GRPO's
  `completions.jsonl`) at the end. The experiment is `logging.mlflow.experiment`, else W&B's group (the
  config file's stem); the MLflow run's name is the run name.
- Resume: the MLflow run id is recorded in `run_dir/mlflow_run.json` and a resume continues that run.
  MLflow's metric history is append-only (no call replaces or deletes a logged point), so a metric's step
  that the run already holds is not sent again: the steps a killed launch logged after its checkpoint keep,
  in MLflow, the values first logged (a resume trains them again to the same losses; `metrics.jsonl` and
  TensorBoard hold the values of the launch that trained them last). Parameters the run already has stay as
  first logged (MLflow refuses to change one); the re-uploaded `config.yaml` holds the current config.
- Never a failed run for a tracker: a store that cannot be reached at the start, or fails later, is one
  notice, and the run goes on logging to `metrics.jsonl` (and its other sinks).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerofit.config.loader import flatten
from zerofit.core.messages import say
from zerofit.core.run_layout import CONFIG_FILE, RUN_INFO_FILE, SUMMARY_FILE, RunLayout
from zerofit.engine_spec.run_plan import RunPlan
from zerofit.metrics.base import NOT_NUMERIC, plottable
from zerofit.metrics.wandb_sink import default_group

URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_STORE = "mlflow.db"  # under output_dir: `sqlite:///<output_dir>/mlflow.db`
DEFAULT_ARTIFACTS = "mlartifacts"  # under output_dir, for the default store's experiments
# MLflow's limits (mlflow.utils.validation): names, parameter values, entries of one batch call.
MAX_NAME = 250
MAX_PARAM_VALUE = 6000
PARAMS_PER_CALL = 100
# A name MLflow takes everywhere (its rule without the colon, which Windows refuses).
_NAME_REFUSED = re.compile(r"[^/\w.\- ]")
# A run id as MLflow writes them (read back from a run folder: data, checked before use).
_RUN_ID = re.compile(r"^[A-Za-z0-9][\w\-]{0,255}$")
# Files of the run folder uploaded as artifacts: at the start, and at the end.
START_ARTIFACTS = (CONFIG_FILE, RUN_INFO_FILE)
END_ARTIFACTS = (SUMMARY_FILE, "completions.jsonl")


def tracking_uri(plan: RunPlan) -> str:
    """The store the run logs to: the config's key, else `MLFLOW_TRACKING_URI`, else the default store."""
    configured = plan.config.logging.mlflow.tracking_uri or os.environ.get(URI_ENV)
    return configured or default_store_uri(plan.run_dir.parent)


def default_store_uri(output_dir: Path) -> str:
    """`sqlite:///<output_dir>/mlflow.db`, the absolute path (a run launched from elsewhere finds it)."""
    return f"sqlite:///{(output_dir.resolve() / DEFAULT_STORE).as_posix()}"


def metric_name(key: str) -> str:
    """`key` as MLflow takes it: each refused character (a comma, a colon, ...) as `_`, at most 250 long."""
    return _NAME_REFUSED.sub("_", key)[:MAX_NAME]


def quiet_mlflow() -> None:
    """MLflow's and its database migrations' INFO lines ("Creating initial MLflow database tables") stay out
    of the run's output: the console sink owns it."""
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


class MlflowSink:
    """Logs to one MLflow run; see the module docstring for the rules it keeps."""

    def __init__(
        self,
        plan: RunPlan,
        *,
        config_path: str | Path | None = None,
        resume: bool = False,
        notice: Callable[[str], None] = say,
    ) -> None:
        self._notice = notice
        self._plan = plan
        self.layout = RunLayout(plan.run_dir)
        self.uri = tracking_uri(plan)
        self.client: Any = None
        self.run_id = ""
        self._held: dict[str, int] = {}  # a resumed run's metrics: the last step MLflow holds of each
        self._params: set[str] = set()  # a resumed run's parameters (kept as first logged)
        self._labels: dict[str, str] = {}
        try:
            from mlflow.tracking import MlflowClient

            quiet_mlflow()  # after the import: mlflow sets its logger's level when imported
            self.client = MlflowClient(tracking_uri=self.uri)
            self.run_id = (self._continued() if resume else "") or self._started(config_path)
        except Exception as exc:  # no server, a refused store: never fail the training run
            self._stop_logging("could not start", exc)

    def _experiment_id(self, config_path: str | Path | None) -> str:
        """The experiment's id, created when new (the default store's artifacts under output_dir)."""
        from mlflow.exceptions import MlflowException

        name = self._plan.config.logging.mlflow.experiment or default_group(self._plan, config_path)
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        output_dir = self._plan.run_dir.parent
        default = self.uri == default_store_uri(output_dir)
        artifacts = (output_dir.resolve() / DEFAULT_ARTIFACTS).as_uri() if default else None
        try:
            return str(self.client.create_experiment(name, artifact_location=artifacts))
        except MlflowException:  # another run created it meanwhile
            return str(self.client.get_experiment_by_name(name).experiment_id)

    def _started(self, config_path: str | Path | None) -> str:
        """A new MLflow run, its id recorded in `mlflow_run.json` for the run's resumes."""
        experiment_id = self._experiment_id(config_path)
        tags = {"zerofit.run_dir": str(self._plan.run_dir.resolve()), "mlflow.source.name": "zerofit"}
        run = self.client.create_run(experiment_id, run_name=self._plan.run_name, tags=tags)
        record = {"run_id": run.info.run_id, "experiment_id": experiment_id}
        self.layout.mlflow_run.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        return str(run.info.run_id)

    def _continued(self) -> str:
        """The recorded MLflow run, set running again with what it holds noted (its metrics' last steps, its
        parameters); "" when there is none to continue (no record, or this store does not have it)."""
        run_id = recorded_run_id(self.layout.mlflow_run)
        if not run_id:
            return ""
        try:
            run = self.client.get_run(run_id)
        except Exception:
            self._notice(f"zerofit: MLflow run {run_id} (from {self.layout.mlflow_run}) is not in {self.uri}; "
                         "this launch logs to a new MLflow run")  # fmt: skip
            return ""
        for key in run.data.metrics:
            steps = [m.step for m in self.client.get_metric_history(run_id, key)]
            self._held[key] = max(steps, default=0)
        self._params = set(run.data.params)
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _stop_logging(self, what: str, exc: BaseException) -> None:
        text = str(exc).strip().splitlines()
        self._notice(
            f"zerofit: MLflow {what} ({self.uri}): {type(exc).__name__}: {text[0] if text else ''}; this run "
            "logs on to metrics.jsonl (and its other sinks)"
        )
        self.client = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        points, tags = [], []
        for key, value in metrics.items():
            converted = plottable(value) if key != "step" else None
            name = metric_name(key)
            if converted is NOT_NUMERIC:
                if self._labels.get(name) != str(value):
                    self._labels[name] = str(value)
                    tags.append(RunTag(name, str(value)))
            elif converted is not None and step > self._held.get(name, 0):
                points.append(Metric(name, float(converted), now, step))
        if not points and not tags:  # every step of this row is in the run already (a resume's)
            return
        try:
            self.client.log_batch(self.run_id, metrics=points, tags=tags)
        except Exception as exc:  # the server went away mid-run
            self._stop_logging("stopped logging", exc)

    def log_config(self, config: dict[str, Any]) -> None:
        """The config as parameters (those the run lacks), and the run folder's files as artifacts."""
        if self.client is None:
            return
        from mlflow.entities import Param

        params = [
            Param(metric_name(key), str(value)[:MAX_PARAM_VALUE])
            for key, value in flatten(config).items()
            if metric_name(key) not in self._params
        ]
        try:
            for start in range(0, len(params), PARAMS_PER_CALL):
                self.client.log_batch(self.run_id, params=params[start : start + PARAMS_PER_CALL])
            engine = self.layout.engine_file(self._plan.spec.strategy).name
            self._upload((*START_ARTIFACTS, engine))
        except Exception as exc:
            self._stop_logging("stopped logging", exc)

    def _upload(self, names: tuple[str, ...]) -> None:
        for name in names:
            path = self.layout.root / name
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        """Upload the end's files and end the MLflow run: FAILED while an error ends the launch, else
        FINISHED (a stopped run's resume sets it running again)."""
        if self.client is None:
            return
        client, failed = self.client, sys.exc_info()[0] is not None
        try:
            self._upload(END_ARTIFACTS)
            client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        except Exception as exc:
            self._stop_logging("could not finish", exc)
        self.client = None


def recorded_run_id(path: Path) -> str:
    """The MLflow run id `mlflow_run.json` records ("" when the file is absent or holds no run id)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return ""
    run_id = data.get("run_id") if isinstance(data, dict) else None
    return run_id if isinstance(run_id, str) and _RUN_ID.match(run_id) else ""
