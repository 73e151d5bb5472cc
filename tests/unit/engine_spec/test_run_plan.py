"""The run plan is made once and never rebuilt: what the launch decided after
`resolve()` (the run directory as found on disk, the resume point, the data's format and epoch length)
lands in one frozen `RunPlan`, made by `make_run_plan` only, and no code replaces a field of it or of
the config it holds."""

from __future__ import annotations

import ast
import dataclasses
import itertools
from pathlib import Path

import pytest

from config_helpers import DEMO_DATA, new_run_plan
from zerofit.config import ZerofitConfig, load_config
from zerofit.engine_spec import render_spec
from zerofit.engine_spec.run_plan import DataFacts, RunDirDecision, RunPlan, make_run_plan
from zerofit.resolution import resolve

REPO = Path(__file__).resolve().parents[3]
# Code a user runs: the package, the launchers and the benchmarks (tests build their configs by hand).
SOURCES = [
    *sorted((REPO / "src" / "zerofit").rglob("*.py")),
    *sorted((REPO / "launchers").glob("*.py")),
    *sorted((REPO / "benchmarks").glob("*.py")),
]
# The one module that builds each: resolution (config alone) and the run plan (the launch's facts too).
MAKERS = {
    "RunPlan": "src/zerofit/engine_spec/run_plan.py",
    "ResolvedConfig": "src/zerofit/resolution/pipeline.py",
}
# Where a config's fields may be assigned: resolution fills them, make_run_plan settles the launch's.
# The resolution and the rules it runs (by area, and each objective's settle_batch / check / fill), and the run
# plan: nothing else writes a config field.
CONFIG_WRITERS = (
    "src/zerofit/config/",
    "src/zerofit/resolution/",
    "src/zerofit/objectives/",
    "src/zerofit/engine_spec/run_plan.py",
)


def _resolved(*overrides: str):
    return resolve(
        load_config(
            None,
            [
                f"data.path={DEMO_DATA}",
                "distributed.strategy=single",
                "batch.global_batch_size=4",
                "batch.micro_batch_size=2",
                *overrides,
            ],
        ),
        1,
    )


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _config_fields() -> dict[str, set[str]]:
    """Section name -> its field names, for every section of the schema."""
    out = {}
    for name, field in ZerofitConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            out[name] = set(annotation.model_fields)
    return out


def _attribute_chain(node: ast.expr) -> list[str]:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return names[::-1]


def test_only_its_maker_constructs_a_run_plan_or_a_resolved_config() -> None:
    found = []
    for path in SOURCES:
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and _called_name(node) in MAKERS
                and MAKERS[_called_name(node)] != rel
            ):
                found.append(f"{rel}:{node.lineno} builds a {_called_name(node)}")
            # dataclasses.replace / copy.replace copy a plan with changes: a rebuild by another name.
            if isinstance(node, ast.Call) and _called_name(node) == "replace" and node.args:
                target = ast.unparse(node.args[0])
                if any(word in target for word in ("resolved", "run_plan", "run.plan", "plan")) and (
                    "scn" not in target
                ):
                    found.append(f"{rel}:{node.lineno} replaces fields of {target}")
    assert found == []


def test_no_code_writes_a_config_field_after_resolution() -> None:
    sections = _config_fields()
    found = []
    for path in SOURCES:
        rel = str(path.relative_to(REPO))
        if rel.startswith(CONFIG_WRITERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                chain = _attribute_chain(target) if isinstance(target, ast.Attribute) else []
                if any(a in sections and b in sections[a] for a, b in itertools.pairwise(chain)):
                    found.append(f"{rel}:{node.lineno} assigns {'.'.join(chain)}")
    assert found == []


def test_a_run_plan_cannot_be_rebuilt_copied_with_changes_or_changed() -> None:
    plan = new_run_plan(_resolved())
    with pytest.raises(TypeError, match=r"made once, by zerofit\.engine_spec\.run_plan\.make_run_plan"):
        dataclasses.replace(plan, run_dir=Path("elsewhere"))
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    with pytest.raises(TypeError, match="made once"):
        RunPlan(**fields)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.run_dir = Path("elsewhere")  # type: ignore[misc]


def test_the_plan_holds_what_the_launch_decided_and_leaves_the_resolution_as_it_was() -> None:
    resolved = _resolved("train.epochs=2", "train.max_steps=null", "run_name=r")
    before = resolved.config.model_dump()
    plan = make_run_plan(
        resolved,
        render_spec(resolved),
        RunDirDecision(run_name="r-2"),
        DataFacts(format="prompt_response", steps_per_epoch=7),
    )
    assert (plan.run_name, plan.run_dir) == ("r-2", Path(resolved.config.output_dir) / "r-2")
    assert (plan.config.data.format, plan.config.train.max_steps) == ("prompt_response", 14)
    assert plan.batch == resolved.batch and plan.resume is None
    assert resolved.config.model_dump() == before  # resolve()'s result is not changed by the launch
    # A format the user named is kept, whatever the data reader reports.
    named = _resolved("data.format=messages")
    assert make_run_plan(
        named, render_spec(named), data=DataFacts("prompt_response", 3)
    ).config.data.format == ("messages")
