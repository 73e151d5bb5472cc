"""The planner knows online RL (`train.objective: grpo`, zerofit.planner.rl): the generation phase (the KV
cache of the rank's completions x (prompt + completion), the sampling logits, the prefill's layer), training on
micro-batches of completions of prompt + completion tokens (one sequence each, not a pair), the reference pass
for beta > 0 and the log-probs kept for it and for the old policy; `zerofit plan` prints the step in prompts,
completions and tokens and names the rewards; the shipped Qwen2.5-7B recipe fits a 3090."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from config_helpers import DEMO_DATA, config
from zerofit.config import load_config
from zerofit.engine_spec import render_spec
from zerofit.planner import choose_fastest_plan
from zerofit.planner.estimate import estimate
from zerofit.planner.rl import RLShape, generation_lines, held_lines
from zerofit.planner.scenario import Scenario, scenario_for
from zerofit.planner.search.budget import resolve_budget
from zerofit.planner.shapes import model_shape
from zerofit.planner.speed import predict_speed
from zerofit.resolution import resolve

REPO = Path(__file__).resolve().parents[3]
QWEN = "Qwen/Qwen2.5-7B"


def test_generation_lines_by_hand_for_qwen25_7b() -> None:
    rl = RLShape(
        completions=16,
        prompt_len=256,
        completion_len=1024,
        reference=False,
        old_policy=False,
        objective="grpo",
    )
    shape = model_shape(QWEN)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.vocab_size) == (28, 4, 128, 152064)
    lines = list(generation_lines(rl, shape, compute_bytes=2).values())
    assert lines[0] == 2 * 28 * 4 * 128 * 2 * 16 * 1280  # keys and values, bf16, every position: 1.09 GiB
    assert lines[1] == 16 * 152064 * (2 + 4 + 4 + 8)  # half logits, fp32, probabilities, int64 sort indices
    q, kv = 28 * 128, 4 * 128
    assert lines[2] == 16 * 256 * (2 * 3584 + q + 2 * kv + 3 * 18944) * 2
    assert held_lines(rl) == {"rollout: 16 completions' token ids and masks": 16 * 1280 * 10}
    both = held_lines(replace(rl, reference=True, old_policy=True))
    assert list(both.values())[1:] == [16 * 1024 * 4, 16 * 1024 * 4]  # one fp32 log-prob per completion token


def _grpo(**rl: object) -> object:
    raw = {
        "model": {"name_or_path": "tiny-llama"},
        "data": {"path": DEMO_DATA, "max_seq_len": 64},
        "distributed": {"strategy": "ddp"},
        "train": {"objective": "grpo", "precision": "fp32"},
        "batch": {"micro_batch_size": 2},  # the global batch: rl.num_generations x rl.prompts_per_step
        "lora": {"enabled": True},
    }
    settings = {
        "num_generations": 8,
        "prompts_per_step": 2,
        "max_prompt_length": 32,
        "max_completion_length": 96,
    }
    return config(raw, rl={**settings, **rl, "rewards": [{"function": "exact_match"}]})


def _scenario(world_size: int = 1, **rl: object) -> Scenario:
    resolved = resolve(_grpo(**rl), world_size, choose_fastest_plan)
    return scenario_for(resolved.config, render_spec(resolved, device_type="cpu"))


def test_training_is_on_completions_of_prompt_plus_completion_tokens() -> None:
    scn = _scenario()
    assert scn.seq_len == 32 + 96 and scn.rows == 2 and not scn.pairs  # one sequence per completion
    assert scn.rl == RLShape(16, 32, 96, reference=False, old_policy=False, objective="grpo")
    assert scn.reference == "none"
    est = estimate(scn)
    assert set(est.phases_gib) == {"forward/backward", "optimizer step", "generation"}
    assert any("rollout: 16 completions' token ids and masks" in k for k in est.breakdown)
    assert any("the rank's 16 completions generate together" in n for n in est.notes)


def test_the_reference_and_old_policy_passes_count_where_they_cost() -> None:
    plain, both = _scenario(), _scenario(beta=0.04, num_iterations=2)
    assert both.reference == "adapters_off" and both.rl is not None and both.rl.old_policy
    # The reference is one more no-grad forward of each micro-batch: slower, the same peak at most ...
    assert predict_speed(both).step_time_s > predict_speed(plain).step_time_s
    # ... and its log-probs and the old policy's are held through training.
    assert sum(held_lines(both.rl).values()) == sum(held_lines(plain.rl).values()) + 2 * 16 * 96 * 4  # type: ignore[arg-type]
    assert any(
        "no-grad forwards of the reference (adapters off) and of the old policy" in n
        for n in estimate(both).notes
    )


def test_the_generation_phase_is_the_peak_when_the_rollout_is_large() -> None:
    small, large = _scenario(), _scenario(num_generations=64, max_completion_length=4096)
    assert not estimate(small).peak_phase.startswith("generation")
    est = estimate(large)
    assert est.peak_phase == "generation"
    assert any(k.startswith("generation: KV cache (128 completions x 4128 tokens") for k in est.breakdown)
    # Two data-parallel ranks generate half the completions each.
    assert _scenario(world_size=2, num_generations=64).rl.completions == 64  # type: ignore[union-attr]


def test_the_shipped_qwen25_7b_grpo_recipe_fits_a_3090() -> None:
    cfg = load_config(REPO / "configs" / "qwen25-7b-grpo-qlora-3090.yaml", [])
    resolved = resolve(cfg, 1, choose_fastest_plan)
    est = estimate(scenario_for(resolved.config, render_spec(resolved, device_type="cuda")))
    budget = resolve_budget(resolved.config)
    assert budget is not None and est.total_gib <= budget.limit_gib, (est.total_gib, budget)
    assert est.phases_gib["generation"] > 8.0  # the 4-bit model's state plus its 16 x 1,280-token KV cache
    assert est.scenario.seq_len == 1280 and est.scenario.rl.completions == 16  # type: ignore[union-attr]


def test_plan_prints_the_step_in_prompts_completions_and_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerofit.cli import main

    rewards = "rl.rewards=[{function: exact_match}, {function: not_imported_zf.mod:score, weight: 0.5}]"
    assert main(["plan", "--config", str(REPO / "configs" / "demo-grpo.yaml"), rewards]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GRPO step: 4 prompts x 8 generations = 32 completions (32 per rank), at most 640 tokens" in out
    assert (
        "Reward: not_imported_zf.mod:score (imported at launch from module not_imported_zf.mod) x 0.5" in out
    )
    assert "A launch imports: not_imported_zf.mod (your code; nothing imported now)" in out


def test_plan_lists_the_users_tool_and_environment_modules_a_launch_imports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The "A launch imports" line covers every piece of the user's code the config names (reward functions,
    tools, the environment), each module once, none imported by the plan; zerofit's own modules are not
    the user's code."""
    from zerofit.cli import main

    overrides = [
        "rl.rewards=[{function: not_imported_zf.rewards:score}]",
        "rl.tools=[{function: calculator}, {function: not_imported_zf.tools:search}]",
        "rl.environment=not_imported_zf.rewards:Env",
        "rl.max_completion_length=32",
    ]
    assert main(["plan", "--config", str(REPO / "configs" / "demo-grpo.yaml"), *overrides]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "A launch imports: not_imported_zf.rewards, not_imported_zf.tools (your code; nothing imported now)"
        in out
    )
    assert main(["plan", "--config", str(REPO / "configs" / "demo-agent.yaml")]) == 0
    assert "A launch imports" not in capsys.readouterr().out  # its environment is zerofit.demo's
    assert not any(name.startswith("not_imported_zf") for name in sys.modules)
