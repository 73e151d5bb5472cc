"""Each objective has one home: its slice and its registry row. Outside `zerofit/objectives/`, no module of
`src/zerofit` spells an objective's name, compares an objective, or checks an objective's type; the schema's
allowed values are the registry's names; and every objective's own synthetic micro-batch (what
`zerofit plan --probe` trains on) runs a real train step on CPU."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import get_args

import pytest

from zerofit.config.schema import Objective
from zerofit.objectives.registry import OBJECTIVES, objective_named

SRC = Path(__file__).resolve().parents[3] / "src" / "zerofit"
NAMES = set(OBJECTIVES)
# Where a name may stand outside the slices: the key's allowed values and default (held to the registry
# below), and the metric named like the reward-model objective (an RL step's mean reward).
ALLOWED = {("config/schema.py", name) for name in NAMES} | {("metrics/keys.py", "reward")}
COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _is_objective(node: ast.AST) -> bool:
    """Whether an expression is the objective itself (`objective`, `cfg.train.objective`), not what its spec
    says (`objective.unit`) and not a None check."""
    return (isinstance(node, ast.Name) and node.id == "objective") or (
        isinstance(node, ast.Attribute) and node.attr == "objective"
    )


def _offences(path: Path) -> list[str]:
    """Every objective name, objective comparison and objective type check in one module."""
    rel = path.relative_to(SRC).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in NAMES and (rel, node.value) not in ALLOWED:
            found.append(f"{rel}:{node.lineno} spells {node.value!r}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, COMPARISONS) for op in node.ops):
            sides = (node.left, *node.comparators)
            none_check = any(isinstance(s, ast.Constant) and s.value is None for s in sides)
            if any(_is_objective(side) for side in sides) and not none_check:
                found.append(f"{rel}:{node.lineno} compares the objective")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            kinds = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            if "Objective" in kinds:
                found.append(f"{rel}:{node.lineno} checks an objective's type ({kinds})")
    return found


def test_no_module_outside_the_slices_spells_or_compares_an_objective() -> None:
    outside = [p for p in sorted(SRC.rglob("*.py")) if "objectives" not in p.relative_to(SRC).parts]
    offences = [o for path in outside for o in _offences(path)]
    assert not offences, "ask the objective's spec (zerofit.objectives.spec) instead:\n" + "\n".join(offences)


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    planted = SRC / "planted_for_the_test.py"
    source = (
        'def f(cfg, objective, loss):\n    a = "kto"\n    b = cfg.train.objective == a\n'
        "    c = objective in (a,)\n    return isinstance(loss, KTOObjective), b, c\n"
    )
    try:
        planted.write_text(source)
        found = _offences(planted)
    finally:
        planted.unlink()
    assert len(found) == 4, found


def test_the_schema_admits_exactly_the_registered_objectives() -> None:
    assert set(get_args(Objective)) == NAMES
    for name, spec in OBJECTIVES.items():
        assert spec.name == name and objective_named(name) is spec


def _probe_config(name: str) -> object:
    """A tiny-llama LoRA run of `name` on one process, as the probe builds it (no data loaded)."""
    from config_helpers import DEMO_DATA, config

    sections: dict[str, dict[str, object]] = {
        "model": {"name_or_path": "tiny-llama"},
        "lora": {"enabled": True, "r": 4},
        "distributed": {"strategy": "single", "preset": None},
        "data": {"path": DEMO_DATA, "max_seq_len": 32},
        "batch": {"micro_batch_size": 2, "global_batch_size": 2},
        "train": {"objective": name, "max_steps": 1, "precision": "fp32"},
        "logging": {"wandb": {"mode": "disabled"}, "console": False},
    }
    if objective_named(
        name
    ).generates:  # its global batch is completions: 1 prompt x 2, 2 updates per rollout
        sections["rl"] = {
            "num_generations": 2,
            "prompts_per_step": 1,
            "max_prompt_length": 16,
            "max_completion_length": 8,
            "beta": 0.04,
            "num_iterations": 2,
            "rewards": [{"function": "exact_match", "column": "answer"}],
        }
        sections["batch"] = {"micro_batch_size": 2, "global_batch_size": None}
    if name == "gkd":  # a teacher of the student's vocabulary that is another model (a divergence to learn)
        sections["model"] = {"name_or_path": "tiny-mistral"}
        sections["rl"] = {"num_generations": 2, "prompts_per_step": 1, "max_prompt_length": 16,
                          "max_completion_length": 8}  # fmt: skip
        sections["gkd"] = {"teacher": "tiny-mixtral"}
        sections["batch"] = {"micro_batch_size": 2, "global_batch_size": None}
    return config({}, **sections)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_objectives_probe_batch_trains_one_real_step(name: str, tmp_path: Path) -> None:
    from zerofit.loop.train import train_step
    from zerofit.recipe.assembly import assemble
    from zerofit.resolution import resolve

    cfg = _probe_config(name)
    cfg.output_dir = str(tmp_path)  # type: ignore[attr-defined]
    run = assemble(resolve(cfg, 1), with_data=False)  # type: ignore[arg-type]
    try:
        objective, resolved = run.plan.objective, run.plan.config
        vocab = int(run.built.model.config.get_text_config().vocab_size)
        seq = objective.max_tokens_per_unit(resolved)[0]
        batch = objective.synthetic_batch(2, seq, vocab, int(run.built.tokenizer.pad_token_id), resolved)
        result = train_step(
            run.strategy, run.model, [batch], 1.0, resolved.train.cross_entropy, run.objective
        )
    finally:
        run.close()
    assert math.isfinite(result.loss) and math.isfinite(result.grad_norm), (name, result)
    assert result.grad_norm > 0, f"{name}: the synthetic batch trained nothing"
