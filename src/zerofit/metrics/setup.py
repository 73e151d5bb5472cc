"""`open_sinks`: the one place that decides where a run's metrics go.

Rank 0 gets `metrics.jsonl` (always, docs/contracts.md), `run_info.json` + `summary.json`, W&B (unless
disabled), the console (if `logging.console`), TensorBoard (`logging.tensorboard`) and MLflow
(`logging.mlflow.enabled`), any of them together, each given the same rows; every other rank gets a
`NullSink`, so the training loop logs unconditionally and never branches on rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerofit.core.run_layout import RunLayout
from zerofit.engine_spec.run_plan import RunPlan
from zerofit.metrics.base import JsonlSink, MetricsSink, MultiSink, NullSink
from zerofit.metrics.run_info import git_commit, library_versions, planner_prediction
from zerofit.metrics.summary import RunFilesSink, predicted_peak_gib

if TYPE_CHECKING:
    from zerofit.metrics.console import ConsoleSink
    from zerofit.metrics.wandb_sink import WandbSink


def run_config(plan: RunPlan, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything that defines a run, as one JSON-able dict (for W&B config and `run_info.json`).

    The fully resolved config, the batch plan, world size and run dir, the engine config (the spec as the
    engine received it), the planner's prediction for that spec, library versions, the git commit, and
    whatever the caller passes in `extra_config` (parameter counts, data stats); the caller's keys win on a
    clash.
    """
    batch = plan.batch
    out: dict[str, Any] = plan.config.model_dump(mode="json")
    out["batch_plan"] = {
        "global_batch_size": batch.global_batch_size,
        "micro_batch_size": batch.micro_batch_size,
        "grad_accum_steps": batch.grad_accum_steps,
        "dp_size": batch.dp_size,
    }
    out["world_size"] = plan.world_size
    out["run_dir"] = str(plan.run_dir)
    out["method"] = plan.method
    out["effective_lr"] = plan.effective_lr
    out["engine_config"] = plan.spec.to_json()
    prediction = planner_prediction(plan)
    if prediction is not None:
        out["planner_prediction"] = prediction
    out["versions"] = library_versions()
    out["git"] = git_commit()
    out.update(extra_config or {})
    return out


def open_sinks(
    plan: RunPlan,
    rank: int,
    extra_config: dict[str, Any],
    *,
    config_path: str | Path | None = None,
    history: list[dict[str, Any]] | None = None,
    prior_wall_s: float = 0.0,
    under_deepspeed_launcher: bool = False,
) -> MetricsSink:
    """The sinks for this rank, with the run config already logged (`log_config`) on rank 0.

    `config_path` (the YAML the user passed) names the W&B group when `logging.wandb.group` is unset;
    without it the group is the run name minus its split suffix. A resumed run passes `history` (the
    kept rows of metrics.jsonl) and `prior_wall_s`: the summaries then cover the whole run, and W&B
    continues the run's id. `under_deepspeed_launcher`: W&B's service is started outside the rank's
    process tree, which DeepSpeed's launcher terminates on Ctrl-C (`WandbSink`'s `outlive_launcher`).
    """
    if rank != 0:
        return NullSink()
    cfg = plan.config
    run_dir = plan.run_dir
    config = run_config(plan, extra_config)
    summaries: list[RunFilesSink | WandbSink | ConsoleSink] = [
        RunFilesSink(run_dir, predicted_peak_gib(config))
    ]
    if cfg.logging.wandb.mode != "disabled":
        from zerofit.metrics.wandb_sink import WandbSink

        summaries.append(
            WandbSink(
                plan,
                config_path=config_path,
                resume=history is not None,
                outlive_launcher=under_deepspeed_launcher,
            )
        )
    if cfg.logging.console:
        from zerofit.metrics.console import ConsoleSink

        summaries.append(ConsoleSink(cfg.train.max_steps, title=cfg.run_name or "train"))
    for summary in summaries:
        summary.resume_from(history or [], prior_wall_s)
    trackers = _trackers(plan, config_path, history)
    sink = MultiSink([JsonlSink(RunLayout(run_dir).metrics), *summaries, *trackers])
    sink.log_config(config)
    return sink


def _trackers(
    plan: RunPlan, config_path: str | Path | None, history: list[dict[str, Any]] | None
) -> list[MetricsSink]:
    """TensorBoard and MLflow as the config asks (after the run files: MLflow uploads `summary.json` at
    close). A resume (`history`, the kept rows) continues TensorBoard's directory from the step after the
    last kept row, and the recorded MLflow run."""
    logging = plan.config.logging
    trackers: list[MetricsSink] = []
    if logging.tensorboard:
        from zerofit.metrics.tensorboard_sink import TensorBoardSink

        first_step = max((int(row["step"]) for row in history or []), default=0) + 1
        trackers.append(TensorBoardSink(plan.run_dir, first_step))
    if logging.mlflow.enabled:
        from zerofit.metrics.mlflow_sink import MlflowSink

        trackers.append(MlflowSink(plan, config_path=config_path, resume=history is not None))
    return trackers
