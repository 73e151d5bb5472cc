"""The planner counts a distillation teacher (`train.objective: gkd`, zerofit.planner.teacher): its weights
whole on every rank in every phase (quantized with gkd.teacher_load_in), and both models' logits of a
micro-batch in training; a run folder teacher has its recorded base's shape."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from config_helpers import DEMO_DATA, config
from zerofit.engine_spec import render_spec
from zerofit.planner import choose_fastest_plan
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario, scenario_for
from zerofit.planner.shapes import model_shape
from zerofit.planner.teacher import teacher_base
from zerofit.resolution import resolve

TEACHER = "Qwen/Qwen2.5-7B"  # catalogued: its shape needs no network


def _scenario(**gkd: object) -> Scenario:
    raw = {
        "model": {"name_or_path": "tiny-llama"},
        "data": {"path": DEMO_DATA},
        "distributed": {"strategy": "ddp"},
        "train": {"objective": "gkd", "precision": "bf16"},
        "batch": {"micro_batch_size": 2},
        "lora": {"enabled": True},
    }
    rl = {"num_generations": 2, "prompts_per_step": 4, "max_prompt_length": 32, "max_completion_length": 96}
    resolved = resolve(config(raw, rl=rl, gkd={"teacher": TEACHER, **gkd}), 1, choose_fastest_plan)
    return scenario_for(resolved.config, render_spec(resolved, device_type="cpu"))


def test_the_teachers_weights_and_logits_are_counted() -> None:
    scn = _scenario()
    assert scn.teacher == TEACHER and scn.teacher_load_in == "none"
    shape = model_shape(TEACHER)
    est, without = estimate(scn), estimate(replace(scn, teacher=None))
    weights = f"teacher: weights ({shape.total_params:,} params)"
    logits = f"distillation: teacher and student logits (2 x 2 x 128 x {shape.vocab_size:,}, fp32)"
    assert est.breakdown[weights] * 2**30 == shape.total_params * 2  # bf16, whole on the rank
    assert est.breakdown[logits] * 2**30 == 2 * 2 * 128 * shape.vocab_size * 4
    assert est.tensors_gib - without.tensors_gib >= shape.total_params * 2 / 2**30
    assert all(est.phases_gib[p] > without.phases_gib[p] for p in est.phases_gib)  # held in every phase


def test_a_quantized_teacher_counts_fewer_bytes() -> None:
    full, eight, four = (estimate(_scenario(teacher_load_in=q)) for q in ("none", "8bit", "4bit"))
    assert full.tensors_gib > eight.tensors_gib > four.tensors_gib
    assert any(k.endswith("params, 4bit)") for k in four.breakdown)


def test_a_run_folder_teacher_has_its_bases_shape(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": TEACHER}}))
    assert teacher_base(str(tmp_path)) == TEACHER and teacher_base("tiny-llama") == "tiny-llama"
