"""The lm-eval tasks zerofit ships (`tasks/*.yaml`): their names, and each one's config with its data file
found where this install keeps it, so `zerofit eval` runs them with no network.

A task YAML names its JSON Lines file relative to a zerofit checkout (`data/demo_smollm2_heldout.jsonl`:
`lm_eval --include_path src/zerofit/harness/tasks` from the checkout's root runs them as they are); the wheel
carries the same files under `zerofit/harness/data/` (pyproject's force-include), and `task_config` points
`data_files` at whichever copy exists. The YAMLs' `!function` tags may name only the verdicts of
`zerofit.harness.checks`: the files are zerofit's own, and this loader imports nothing else.
"""

from __future__ import annotations

import importlib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = ["TASKS_DIR", "data_dir", "shipped_names", "task_config"]

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
_CHECKS = "zerofit.harness.checks"


def data_dir() -> Path:
    """Where the shipped tasks' data files are: inside the installed wheel, else the checkout's `data/`."""
    packaged = Path(str(resources.files("zerofit"))) / "harness" / "data"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "data"


def shipped_names() -> list[str]:
    """The names of the tasks zerofit ships, sorted (each YAML's stem is its `task:`)."""
    return sorted(path.stem for path in TASKS_DIR.glob("*.yaml"))


class _TaskLoader(yaml.SafeLoader):
    """YAML's safe loader plus lm-eval's `!function module.name` tag, limited to `zerofit.harness.checks`."""


def _function(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    qualified = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    module, _, name = qualified.rpartition(".")
    if module != _CHECKS:
        raise ValueError(f"!function {qualified}: a shipped task may name only {_CHECKS}'s verdicts")
    return getattr(importlib.import_module(module), name)


_TaskLoader.add_constructor("!function", _function)


def task_config(name: str) -> dict[str, Any]:
    """The lm-eval config of shipped task `name`, its data files at `data_dir()` (absolute paths)."""
    config: dict[str, Any] = yaml.load((TASKS_DIR / f"{name}.yaml").read_text(encoding="utf-8"), _TaskLoader)
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {
        split: str(data_dir() / Path(path).name) for split, path in files.items()
    }
    return config
