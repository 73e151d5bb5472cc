"""The plan form as the command line's words: a field changed from its file's value is one override, a
remedy's button applies exactly the planner's overrides (its plan is the remedy's predicted plan), and a
problem of the CLI's paragraph is filed beside the field it names."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from zerofit.studio.form import CommandLine, PlanForm, apply_remedy, base_form, field_overrides
from zerofit.studio.planning import plan_form
from zerofit.studio.security import Workspace

REPO = Path(__file__).resolve().parents[3]
FULL_7B = "configs/llama2-7b-full-zero3-offload-3090.yaml"


def test_unchanged_fields_add_no_override_and_changed_ones_add_the_cli_words() -> None:
    base = base_form(str(REPO / "configs" / "demo.yaml"))
    assert field_overrides(base, base) == []
    changed = replace(base, method="qlora", preset="single", seq_len=128, overrides=["train.max_steps=5"])
    assert field_overrides(changed, base) == [
        "lora.enabled=true",
        "quantization.load_in=4bit",
        "distributed.strategy=single",
        "distributed.preset=null",
        "data.max_seq_len=128",
        "train.max_steps=5",
    ]
    line = CommandLine.of(replace(changed, num_gpus=2, gpu="rtx3090"), base)
    assert line.lines()["launch"].startswith("torchrun --nproc_per_node 2 launchers/launch_finetune.py")
    assert "--gpu rtx3090" in line.lines()["plan"]


def test_a_remedy_sets_the_fields_it_names_and_keeps_the_rest_as_overrides() -> None:
    form = PlanForm(config=FULL_7B, method="full", preset="zero2", overrides=["train.max_steps=5"])
    qlora = apply_remedy(
        form,
        "lora.enabled=true quantization.load_in=4bit distributed.strategy=single distributed.preset=null "
        "batch.micro_batch_size=1",
    )
    assert (qlora.method, qlora.preset) == ("qlora", "single")
    assert qlora.overrides == ["train.max_steps=5", "batch.micro_batch_size=1"]
    wider = apply_remedy(form, "launch 8 ranks (e.g. deepspeed --num_gpus 8) with distributed.preset=zero3")
    assert (wider.num_gpus, wider.preset, wider.method) == (8, "zero3", "full")


@pytest.mark.slow
def test_each_remedy_button_plans_what_the_remedy_predicted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    workspace = Workspace(REPO)
    form = replace(base_form(FULL_7B), config=FULL_7B, preset="zero2", gpu="rtx3090")
    remedies = plan_form(workspace, form)["report"]["memory"]["remedies"]
    assert len(remedies) >= 3
    for remedy in remedies:
        applied = plan_form(workspace, apply_remedy(form, remedy["how"]))
        memory = applied["report"]["memory"]
        assert (memory["total_gib"], memory["verdict"]) == (remedy["total_gib"], remedy["verdict"]), remedy


def test_a_cli_problem_is_shown_beside_the_field_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    form = replace(base_form("configs/demo.yaml"), config="configs/demo.yaml", seq_len=0)
    answer = plan_form(Workspace(REPO), form)
    (paragraph,) = answer["problems"]["seq_len"]
    assert paragraph.startswith("Invalid configuration: data.max_seq_len") and paragraph in answer["error"]
