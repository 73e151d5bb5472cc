"""The planner counts preference tuning: a micro-batch of m pairs is a forward of 2m sequences (memory, tokens,
step time), DPO's reference with the adapters off is one more no-grad forward of those rows (its own moments and
its FLOPs), a precomputed reference costs nothing per step, the tensor trace still agrees with the analytic
model, `batch.micro_batch_size: auto` chooses pairs, and `zerofit plan` says what it planned."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from zerofit.objectives.pairwise import DPO
from zerofit.objectives.registry import objective_named
from zerofit.objectives.sft import SFT
from zerofit.planner.activations.peak import activation_terms
from zerofit.planner.activations.terms import TermKind
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import model_shape
from zerofit.planner.speed import flops_per_token, predict_speed
from zerofit.planner.trace import trace_memory

REPO = Path(__file__).resolve().parents[3]
L7 = "meta-llama/Llama-2-7b-hf"
TINY = "tiny-llama"
LORA_7B = dict(
    model=L7, seq_len=1024, strategy="deepspeed", zero_stage=2, lora=True, activation_checkpointing=True
)


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_m_pairs_cost_what_2m_sequences_cost(objective: str) -> None:
    sft = Scenario(micro_batch_size=4, grad_accum_steps=4, **LORA_7B)  # type: ignore[arg-type]
    pairs = replace(
        sft, micro_batch_size=2, objective=objective_named(objective), reference="precomputed"
    )  # 8 pairs a step
    assert pairs.rows == 4
    assert estimate(pairs).tensors_gib == estimate(sft).tensors_gib  # the same activations, logits, loss
    assert activation_terms(pairs).lines == activation_terms(sft).lines
    # The same sequences per step, so the same step time and tokens/s (both sequences of a pair count).
    assert predict_speed(pairs).step_time_s == pytest.approx(predict_speed(sft).step_time_s)
    assert predict_speed(pairs).tokens_per_s == pytest.approx(predict_speed(sft).tokens_per_s)
    # ... and twice what m sequences cost.
    assert estimate(pairs).tensors_gib > estimate(replace(sft, micro_batch_size=2)).tensors_gib


def test_the_reference_with_adapters_off_is_a_no_grad_forward_of_the_same_rows() -> None:
    base = Scenario(micro_batch_size=2, objective=DPO, reference="precomputed", **LORA_7B)  # type: ignore[arg-type]
    off = replace(base, reference="adapters_off")
    moments = {m.where: m for m in activation_terms(off).moments}
    layer = moments["reference forward (adapters off, no grad): a decoder layer"]
    log_probs = moments["reference forward (adapters off, no grad): its log-probs"]
    assert all(t.kind is TermKind.REFERENCE_FORWARD and not t.saved_for_backward for t in layer.terms)
    shape, tokens = model_shape(L7), 4 * 1024  # 2 pairs = 4 rows of 1024 tokens
    # bf16 residual stream + boolean mask (B x S x S) + sdpa's additive bf16 mask (B x S x S) + rotary.
    stream = (
        2 * shape.hidden_size * tokens + tokens * 1024 + 2 * tokens * 1024 + 2 * 1024 * shape.head_dim * 2
    )
    assert layer.terms[0].bytes == stream
    chunk = min(2**27 // (4 * shape.vocab_size), tokens)
    # bf16 logits, the chunked loss's fp32 chunk and its logsumexp temporary, per-token lse + targets.
    expected = 2 * shape.vocab_size * tokens + 2 * 4 * shape.vocab_size * chunk + 12 * tokens
    assert log_probs.total == expected
    # Nothing is saved, so it is no peak here; the memory is that of the precomputed reference ...
    assert estimate(off).tensors_gib == estimate(base).tensors_gib
    assert "reference forward" not in estimate(off).peak_phase
    # ... and its time is one more forward of the base per token: 2 N + 4 L h s.
    layers = shape.num_layers
    forward = 2 * (shape.layer_linear_weight_params * layers + shape.vocab_size * shape.hidden_size)
    forward += 4 * layers * shape.hidden_size * 1024
    assert flops_per_token(off)[0] - flops_per_token(base)[0] == pytest.approx(forward)
    assert predict_speed(off).tokens_per_s < predict_speed(base).tokens_per_s
    assert any("reference adapters_off" in note for note in estimate(off).notes)
    assert any("computed once before training" in note for note in estimate(base).notes)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "strategy", "seq", "micro", "ckpt", "reference"),
    [
        (TINY, "deepspeed", 512, 2, True, "adapters_off"),
        (TINY, "single", 256, 3, False, "precomputed"),
    ],
)
def test_the_trace_of_2m_rows_and_the_reference_forward_agrees_within_5_percent(
    model: str, strategy: str, seq: int, micro: int, ckpt: bool, reference: str
) -> None:
    scn = Scenario(
        model=model,
        seq_len=seq,
        micro_batch_size=micro,
        strategy=strategy,
        activation_checkpointing=ckpt,
        objective=DPO,
        reference=reference,
    )
    traced = trace_memory(scn)
    assert abs(estimate(scn).tensors_gib / traced.tensors_gib - 1) < 0.05, traced.as_dict()
    # The trace ran 2m rows: the estimate of m rows is far from it.
    m_rows = estimate(replace(scn, objective=SFT, reference="none")).tensors_gib
    assert abs(m_rows / traced.tensors_gib - 1) > 0.1


def _dpo_config(*overrides: str) -> object:
    from zerofit.config.loader import load_config

    return load_config(
        REPO / "configs" / "llama2-7b-lora-3090.yaml",
        ["train.objective=dpo", f"data.path={REPO / 'data' / 'demo_preference.jsonl'}", *overrides],
    )


def test_auto_micro_batch_chooses_pairs_that_fit_and_plan_says_what_it_planned() -> None:
    from zerofit.api import plan

    report = plan(_dpo_config("batch.micro_batch_size=auto", "planner.gpu=rtx3090"))  # type: ignore[arg-type]
    memory, batch = report["memory"], report["batch"]
    assert (memory["objective"], memory["reference"]) == ("dpo", "adapters_off")  # LoRA: adapters off
    assert memory["sequences_per_micro_batch"] == 2 * batch["micro_batch_size"]
    assert memory["verdict"] == "fits"
    assert (batch["samples"], batch["max_tokens_per_optimizer_step"]) == ("pairs", 2 * 32 * 1024)
    sft = plan(_dpo_config("batch.micro_batch_size=auto", "planner.gpu=rtx3090", "train.objective=sft",
                           "data.path=data/demo.jsonl"))  # type: ignore[arg-type]  # fmt: skip
    # A pair holds two sequences: the largest micro-batch of pairs that fits is at most SFT's.
    assert batch["micro_batch_size"] <= sft["batch"]["micro_batch_size"]
    assert (
        sft["memory"]["objective"] == "sft"
        and sft["memory"]["sequences_per_micro_batch"] == sft["batch"]["micro_batch_size"]
    )


def test_plan_prints_the_objective_and_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofit.cli import main

    args = ["plan", "--config", str(REPO / "configs" / "llama2-7b-lora-3090.yaml"), "--gpu", "rtx3090"]
    main([*args, "train.objective=dpo", f"data.path={REPO / 'data' / 'demo_preference.jsonl'}"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Planned for train.objective dpo: 4 pairs per micro-batch = 8 sequences per forward" in out
    assert "reference adapters_off, a no-grad forward of the same 8 rows" in out
    assert "preference pairs per optimizer step" in out
