"""What a run was made of, beyond its config: library versions, git commit, planner prediction.

This goes into the W&B config (and `run_info.json` in the run directory) so that two runs that differ
only in a library upgrade or a code change can still be told apart.
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerofit.engine_spec.run_plan import RunPlan

# Libraries whose version changes numerics or memory; the rest are noise.
_LIBRARIES = ("zerofit", "torch", "deepspeed", "transformers", "peft", "bitsandbytes", "accelerate", "wandb")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that matter for a run (absent ones are left out)."""
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        import torch

        versions["cuda"] = str(torch.version.cuda) if torch.version.cuda else "none"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return versions


def git_commit(cwd: str | Path | None = None) -> dict[str, Any]:
    """The git commit of the code (the zerofit checkout, else `cwd`) and whether the tree is dirty.

    Returns `{}` outside a git checkout or without git: never fails a run.
    """
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": sha, "dirty": bool(dirty)}


def planner_prediction(plan: RunPlan) -> dict[str, Any] | None:
    """The memory planner's per-rank prediction for this run (`{"memory": {...}}`), from its engine spec.

    `memory.tensors_gib` is comparable to the measured `peak_gib` on CUDA (max allocated); `memory.total_gib`
    adds the CUDA context and allocator allowance. The prediction is informative only: a model the planner
    cannot shape (an unusual local architecture) gives `None`, never a failed run.
    """
    from zerofit.planner.estimate import estimate
    from zerofit.planner.scenario import scenario_for

    try:
        prediction = estimate(scenario_for(plan.config, plan.spec)).as_dict()
    except Exception:  # a planner gap must not fail training; metrics.jsonl still records what happened
        return None
    return {"memory": prediction}
