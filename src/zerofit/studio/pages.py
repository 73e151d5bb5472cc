"""What each route of the page answers, built from the command line's code (the HTTP side is `server.py`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError, DataError, LaunchError, ZerofitError
from zerofit.core.run_layout import METRICS_FILE
from zerofit.studio.form import ENGINES_WITHOUT_PRESET, METHODS, PlanForm, apply_remedy, base_form
from zerofit.studio.launches import LaunchQueue, write_run_config
from zerofit.studio.planning import plan_form, problems_by_field
from zerofit.studio.runs import find_runs, progress, rows_by_step, run_config, run_state
from zerofit.studio.security import Workspace

LOG_TAIL = 6000  # characters of a job's output the page shows
CONFIG_FOLDERS = ("configs", ".")  # where the config picker looks, under the workspace


def options(workspace: Workspace) -> dict[str, Any]:
    """The plan form's choices: the workspace's configs, the catalogue's models and GPUs, the objectives, the
    engines, the methods."""
    from zerofit.catalogue.gpus import GPUS
    from zerofit.catalogue.models import known_models
    from zerofit.catalogue.presets import list_presets
    from zerofit.objectives.registry import OBJECTIVES

    configs = sorted(
        workspace.relative(p)
        for folder in CONFIG_FOLDERS
        for p in (workspace.root / folder).glob("*.yaml")
        if (workspace.root / folder).is_dir()
    )
    known = known_models()
    return {
        "configs": configs,
        "models": [*known.builtins, *known.hub_ids],
        "gpus": [{"name": g.name, "label": g.description} for g in GPUS.values()],
        "objectives": list(OBJECTIVES),
        "presets": [*list_presets(), *ENGINES_WITHOUT_PRESET],
        "methods": list(METHODS),
    }


def form(workspace: Workspace, config: str) -> dict[str, Any]:
    """The form as the config file fills it, and its plan."""
    workspace.path(config, "config")
    return plan_form(workspace, base_form_or_blank(workspace, config))


def base_form_or_blank(workspace: Workspace, config: str) -> PlanForm:
    """The config file's form; a file that does not load gives a form with only the file named (the plan then
    says why, beside the field)."""
    try:
        return replace(base_form(str(workspace.path(config, "config"))), config=config)
    except ConfigError:
        return PlanForm(config=config)


def plan(workspace: Workspace, body: dict[str, Any]) -> dict[str, Any]:
    """The plan of the posted form (a field that is no number: its paragraph beside it)."""
    try:
        form = PlanForm.from_json(body)
    except ConfigError as exc:
        return {"form": body, "error": str(exc), "problems": problems_by_field(exc)}
    return plan_form(workspace, form)


def remedy(workspace: Workspace, body: dict[str, Any]) -> dict[str, Any]:
    """The posted form with the posted remedy applied, and its plan."""
    return plan_form(
        workspace, apply_remedy(PlanForm.from_json(body.get("form", {})), str(body.get("how", "")))
    )


def launch(workspace: Workspace, queue: LaunchQueue, body: dict[str, Any]) -> dict[str, Any]:
    """Plan the form (a user error stops the launch here), write the resolved config into the plan's run
    folder, queue the launch."""
    planned = plan_form(workspace, PlanForm.from_json(body))
    if "error" in planned:
        return planned
    report = planned["report"]
    run_dir = workspace.path(report["run_dir"], "output_dir/run_name")
    write_run_config(run_dir, report["config"])
    job = queue.submit(run_dir, report["world_size"], resume=False)
    return {**planned, "job": job.as_dict(workspace)}


def resume(workspace: Workspace, queue: LaunchQueue, run: str) -> dict[str, Any]:
    """Queue `run`'s resume on the world size it trained on (`run_info.json`, else its last metrics row)."""
    run_dir = workspace.path(run, "run")
    if run_state(run_dir) == "running":
        raise LaunchError(f"run = {run!r} is running: stop it first, then resume it")
    rows = rows_by_step(run_dir)
    world = int(rows[-1].get("dp_size") or 1) if rows else 1
    return queue.submit(run_dir, world, resume=True).as_dict(workspace)


def state_of(queue: LaunchQueue, run_dir: Path) -> str:
    """The run's state: its studio job's (queued, running, stopping, ...), else what its files say."""
    job = queue.job_of(run_dir)
    if job is not None and job.state in ("queued", "running", "stopping"):
        return job.state
    return run_state(run_dir)


def runs(workspace: Workspace, queue: LaunchQueue) -> dict[str, Any]:
    """Every run folder of the workspace with its state and progress, and this studio's jobs."""
    listed = []
    for run_dir in find_runs(workspace):
        job = queue.job_of(run_dir)
        listed.append(
            {
                "run": workspace.relative(run_dir),
                "state": state_of(queue, run_dir),
                "job": job.as_dict(workspace) if job else None,
                "has_metrics": (run_dir / METRICS_FILE).is_file(),
                **progress(rows_by_step(run_dir), run_config(run_dir)),
            }
        )
    return {"runs": listed, "jobs": [j.as_dict(workspace) for j in queue.jobs.values()]}


def log_tail(workspace: Workspace, queue: LaunchQueue, run: str) -> dict[str, Any]:
    """The end of the newest job's output for `run` (empty for a run this studio did not launch)."""
    job = queue.job_of(workspace.path(run, "run"))
    if job is None or not job.log.is_file():
        return {"log": ""}
    return {"log": job.log.read_text(errors="replace")[-LOG_TAIL:]}


def compare(workspace: Workspace, paths: list[str]) -> dict[str, Any]:
    """`zerofit compare`'s report for the runs (plots in the first run's `compare-<time>` folder), the plots as
    workspace paths the page fetches through /api/file."""
    from zerofit.commands.compare import default_out, load_runs, write_comparison

    if not paths:
        raise DataError("runs: none picked; tick one or more runs to compare")
    run_dirs = [workspace.path(p, "run") for p in paths]
    report = write_comparison(load_runs(run_dirs), default_out(run_dirs[0]))
    report["plots"] = {workspace.relative(Path(p)): series for p, series in report["plots"].items()}
    return json.loads(json.dumps(report, default=str))


def not_a_file(path: str) -> ZerofitError:
    """The refusal of a path that names no file."""
    return DataError(f"path = {path!r}: no such file in the workspace")
