"""The planner's KTO: one row per example, and three no-grad forwards of them per micro-step (the reference
with the adapters off, and the KL pass through the policy and the reference) in the step time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from zerofit.objectives.kto import KTO
from zerofit.objectives.pairwise import DPO
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario
from zerofit.planner.speed import flops_per_token, predict_speed

REPO = Path(__file__).resolve().parents[3]
LORA_7B = dict(
    model="meta-llama/Llama-2-7b-hf", seq_len=1024, strategy="deepspeed", zero_stage=2, lora=True,
    activation_checkpointing=True, micro_batch_size=2,
)  # fmt: skip


def test_kto_counts_its_reference_and_kl_forwards() -> None:
    sft = Scenario(**LORA_7B)  # type: ignore[arg-type]
    dpo = replace(sft, objective=DPO, reference="adapters_off", micro_batch_size=1)  # 2 rows, 1 no-grad
    kto = replace(sft, objective=KTO, reference="adapters_off")
    assert kto.rows == sft.rows == 2 and not kto.pairs and kto.no_grad_forwards == 3
    # The activations are SFT's (the no-grad forwards save nothing) ...
    assert estimate(kto).tensors_gib == estimate(replace(sft, reference="adapters_off")).tensors_gib
    # ... and each token costs three forwards more than SFT's step, two more than DPO's.
    extra = flops_per_token(dpo)[0] - flops_per_token(replace(dpo, reference="precomputed"))[0]
    assert flops_per_token(kto)[0] - flops_per_token(sft)[0] == pytest.approx(3 * extra)
    assert predict_speed(kto).tokens_per_s < predict_speed(dpo).tokens_per_s
    assert any("three no-grad forwards" in note for note in estimate(kto).notes)


def test_plan_of_the_kto_demo_counts_examples(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofit.cli import main

    main(
        [
            "plan",
            "--config",
            str(REPO / "configs" / "demo-kto.yaml"),
            f"data.path={REPO / 'data' / 'demo_kto.jsonl'}",
        ]
    )
    out = capsys.readouterr().out
    assert "samples per optimizer step" in out and "preference pairs" not in out
    assert "Planned for train.objective kto: 4 examples per micro-batch" in out
