"""`zerofit plan --json` of every shipped config gives the numbers of a committed snapshot.

The snapshot (`golden/plan_snapshot.json`) pins what the planner and resolution derive for the configs a user
starts from: the batch plan, the engine config, the schedule, every memory term and the fastest-plan choice.
A refactor of resolution or the planner must leave all of it unchanged. Memory terms are compared by value,
not by label: their wording may change, their bytes may not (the labels are display text, and a refactor
that types the terms keeps the numbers). Regenerate after a deliberate change with
`ZEROFIT_UPDATE_GOLDEN=1 pytest tests/unit/planner/test_plan_snapshot.py` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from zerofit.api import plan

REPO = Path(__file__).resolve().parents[3]
SNAPSHOT = Path(__file__).parents[1] / "golden" / "plan_snapshot.json"
UPDATE_GOLDEN = os.environ.get("ZEROFIT_UPDATE_GOLDEN") == "1"
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
# Dicts keyed by display labels: compared as the sorted list of their values.
LABELLED = ("breakdown", "allowance", "host_breakdown", "activation_bytes_per_token_per_layer")


def _planned(name: str) -> dict[str, Any]:
    """What `zerofit plan --config configs/NAME --gpu rtx3090 --json` prints, as JSON values; the run
    directory as the config names it: the plan's is the `-N` a new run would take next to the runs already
    in output_dir (the checkout's state, not the config's), which the plan's notes then explain."""
    report = json.loads(json.dumps(plan(str(REPO / "configs" / name), gpu="rtx3090"), default=str))
    named = str(Path(report["config"]["output_dir"]) / report["config"]["run_name"])
    report["engine_config_file"] = report["engine_config_file"].replace(report["run_dir"], named, 1)
    report["run_dir"] = named
    report["notes"] = [n for n in report["notes"] if "already holds a run" not in n]
    return report


def _comparable(value: Any, key: str = "") -> Any:
    """`value` with label-keyed dicts reduced to their sorted values (recursively)."""
    if isinstance(value, dict):
        if key.endswith(LABELLED):
            return sorted((_comparable(v) for v in value.values()), key=json.dumps)
        return {k: _comparable(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


def test_the_snapshot_covers_every_shipped_config() -> None:
    if UPDATE_GOLDEN:
        SNAPSHOT.write_text(json.dumps({n: _planned(n) for n in CONFIGS}, indent=1, sort_keys=True) + "\n")
    assert sorted(json.loads(SNAPSHOT.read_text())) == CONFIGS, (
        f"{SNAPSHOT.name} does not list exactly configs/*.yaml; rerun with ZEROFIT_UPDATE_GOLDEN=1"
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_plan_json_gives_the_snapshot_numbers(name: str) -> None:
    expected = json.loads(SNAPSHOT.read_text()).get(name)
    assert expected is not None, f"{name} is not in {SNAPSHOT.name}; rerun with ZEROFIT_UPDATE_GOLDEN=1"
    assert _comparable(_planned(name)) == _comparable(expected), (
        f"zerofit plan --json of configs/{name} differs from {SNAPSHOT.name}; if the change is intended, "
        "rerun with ZEROFIT_UPDATE_GOLDEN=1 and review the diff"
    )
