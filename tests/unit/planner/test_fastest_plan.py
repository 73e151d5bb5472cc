"""The fastest plan under a memory budget: `auto` for checkpointed layers and micro-batch / token budget,
the keys' refusals, and what `zerofit plan` prints (the chosen plan, the runner-up, the speed-up)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from config_helpers import DEMO_DATA, config
from zerofit.cli import main
from zerofit.config import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.engine_spec import render_spec
from zerofit.planner import choose_fastest_plan
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import scenario_for
from zerofit.planner.search.budget import resolve_budget
from zerofit.planner.search.options import fastest_options
from zerofit.planner.search.report import plan_memory
from zerofit.resolution import resolve

REPO = Path(__file__).resolve().parents[3]
L7 = "meta-llama/Llama-2-7b-hf"
LORA_RECIPE = str(REPO / "configs" / "llama2-7b-lora-3090.yaml")


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("zerofit.planner.search.budget.detected_gpu", lambda: None)


def _cfg(**sections: dict[str, Any]) -> ZerofitConfig:
    base = {
        "model": {"name_or_path": L7},
        "data": {"path": DEMO_DATA, "max_seq_len": 1024},
        "batch": {"global_batch_size": 32},
        "distributed": {"strategy": "deepspeed", "preset": "zero2"},
        "planner": {"gpu": "rtx3090"},
        "logging": {"wandb": {"mode": "disabled"}},
    }
    return config(base, **sections)


def test_checkpointing_auto_picks_the_fewest_layers_that_fit() -> None:
    resolved = resolve(
        _cfg(batch={"micro_batch_size": 4}, train={"activation_checkpointing": "auto"}),
        1,
        choose_fastest_plan,
    )
    n = resolved.config.train.activation_checkpointing
    assert isinstance(n, int) and not isinstance(n, bool) and 0 < n < 32  # selective: resolved to a number
    scn = scenario_for(resolved.config, render_spec(resolved))
    budget = resolve_budget(resolved.config)
    assert budget is not None
    fits = [estimate(scn.with_checkpointing(k)).total_gib <= budget.limit_gib for k in (n - 1, n)]
    assert fits == [False, True]  # one layer fewer would not fit


def test_joint_auto_takes_the_fastest_option_and_keeps_the_global_batch() -> None:
    cfg = _cfg(batch={"micro_batch_size": "auto"}, train={"activation_checkpointing": "auto"})
    resolved = resolve(cfg, 1, choose_fastest_plan)
    plan = plan_memory(resolved, render_spec(resolved), resolve_budget(resolved.config))
    assert plan.speed is not None and plan.verdict == "fits"
    speeds = [o.speed.tokens_per_s for o in plan.speed.options]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) >= 2
    chosen = plan.speed.options[0]
    assert (resolved.batch.micro_batch_size, resolved.config.train.activation_checkpointing) == (
        chosen.micro_batch_size,
        chosen.checkpointing,
    )
    assert resolved.batch.global_batch_size == 32
    # Each option checkpoints as few layers as fit at its micro-batch: bigger micro-batches need more.
    by_micro = sorted(plan.speed.options, key=lambda o: o.micro_batch_size)
    layers = [o.checkpointed_layers for o in by_micro]
    assert layers == sorted(layers)
    base = plan.speed.baseline
    assert base is not None and base.checkpointed_layers == 32
    assert chosen.speed.tokens_per_s > base.speed.tokens_per_s


def test_a_token_budget_resolves_to_packed_rows() -> None:
    resolved = resolve(_cfg(batch={"tokens_per_micro_batch": 4096}), 1, choose_fastest_plan)
    assert resolved.batch.micro_batch_size == 4 and resolved.batch.grad_accum_steps == 8
    scn = scenario_for(resolved.config, render_spec(resolved))
    assert scn.packed and scn.micro_batch_size == 4 and scn.masked_attention
    auto = resolve(
        _cfg(batch={"tokens_per_micro_batch": "auto"}, train={"activation_checkpointing": "auto"}),
        1,
        choose_fastest_plan,
    )
    cfg = auto.config
    assert cfg.batch.tokens_per_micro_batch == auto.batch.micro_batch_size * 1024  # no `auto` left
    assert isinstance(cfg.train.activation_checkpointing, (bool, int))


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"batch": {"tokens_per_micro_batch": 3000}},
            "batch.tokens_per_micro_batch = 3000: examples are packed into rows of data.max_seq_len = 1024",
        ),
        (
            {"batch": {"tokens_per_micro_batch": 4096, "micro_batch_size": 4}},
            "a token budget decides the micro-batch",
        ),
        (
            {"batch": {"tokens_per_micro_batch": 3072}},
            "batch.tokens_per_micro_batch = 3072 packs 1024-token rows",
        ),
        ({"batch": {"micro_batch_size": 4}, "train": {"activation_checkpointing": -2}}, "must be >= 0"),
        ({"batch": {"micro_batch_size": 4}, "train": {"cross_entropy": "liger"}}, "pip install liger-kernel"),
    ],
    ids=["not-a-multiple", "both-set", "rows-do-not-divide", "negative-layers", "liger-missing"],
)
def test_bad_settings_name_the_key_and_the_fix(sections: dict[str, Any], expected: str) -> None:
    from zerofit.token_loss.sums import liger_available

    if "liger" in expected and liger_available():
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(ConfigError) as err:
        resolve(_cfg(**sections), 1, choose_fastest_plan)
    assert expected in str(err.value)


def test_auto_checkpointing_without_a_budget_or_room_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing = 'auto' needs the GPU's memory"):
        resolve(
            _cfg(
                batch={"micro_batch_size": 4},
                train={"activation_checkpointing": "auto"},
                planner={"gpu": None},
            ),
            1,
            choose_fastest_plan,
        )
    with pytest.raises(ConfigError) as err:
        resolve(
            _cfg(
                batch={"micro_batch_size": 32},
                train={"activation_checkpointing": "auto"},
                planner={"gpu": "rtx4080"},
            ),
            1,
            choose_fastest_plan,
        )
    assert "not even checkpointing every layer at micro 32 fits" in str(err.value) and "Remedies" in str(
        err.value
    )


def test_the_options_checkpoint_no_layer_when_memory_is_plentiful() -> None:
    resolved = resolve(
        _cfg(batch={"micro_batch_size": 4}, planner={"gpu": "a100-80gb"}), 1, choose_fastest_plan
    )
    scn = scenario_for(resolved.config, render_spec(resolved))
    budget = resolve_budget(resolved.config)
    assert budget is not None
    options = fastest_options(scn, 32, budget)
    assert all(o.checkpointed_layers == 0 for o in options if o.micro_batch_size <= 4)


@pytest.mark.slow
def test_zerofit_plan_prints_the_chosen_plan_runner_up_and_speed_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--config", LORA_RECIPE, "--gpu", "rtx3090"]
    assert main([*args, "batch.micro_batch_size=auto", "train.activation_checkpointing=auto"]) == 0
    out = capsys.readouterr().out
    for line in (
        "Fastest plans that fit",
        "Chosen plan: micro",
        "Runner-up:   micro",
        "Predicted speed-up: ",
    ):
        assert line in out, out
    assert main([*args, "--json"]) == 0
    speed = json.loads(capsys.readouterr().out)["memory"]["speed"]
    assert speed["chosen"]["tokens_per_s"] >= speed["runner_up"]["tokens_per_s"]
    assert speed["configured"]["checkpointed_layers"] == 32  # the recipe as shipped: every layer
    assert speed["speedup_vs_baseline"] == pytest.approx(
        speed["chosen"]["tokens_per_s"] / speed["baseline"]["tokens_per_s"], rel=1e-2
    )


def _option(micro: int, accum: int, layers: int, rate: float) -> dict[str, Any]:
    """One row of `memory.speed` (what `zerofit plan --json` prints), 32 decoder layers."""
    return {
        "micro_batch_size": micro,
        "grad_accum_steps": accum,
        "checkpointed_layers": layers,
        "num_layers": 32,
        "tokens_per_s": rate,
        "total_gib": 22.0,
        "recompute_fraction": layers / 64,
    }


@pytest.mark.parametrize("configured_micro", [1, 2])
def test_the_chosen_plan_line_says_whether_the_run_uses_it(configured_micro: int) -> None:
    """`Chosen plan: micro 1 x accum 32` once read as what runs while the run used its configured micro 2:
    the line says which runs (the fastest plan only when the config leaves both keys to auto)."""
    from rich.console import Console

    from zerofit.planner.plan_report import print_speed

    fastest = _option(1, 32, 11, 574.0)
    configured = fastest if configured_micro == 1 else _option(2, 16, 32, 461.0)
    speed = {
        "rates_of": "rtx3090",
        "reference_rates": False,
        "options": [fastest],
        "chosen": fastest,
        "runner_up": None,
        "baseline": _option(8, 4, 32, 459.2),
        "speedup_vs_baseline": 1.25,
        "configured": configured,
    }
    console = Console(record=True, width=300)
    print_speed(speed, console)
    text = console.export_text()
    if configured_micro == 1:
        assert "Chosen plan: micro 1 x accum 32, checkpointing first 11 of 32 layers" in text
        assert "; this run uses it" in text and "Configured:" not in text
    else:
        assert "Chosen plan" not in text
        assert "Fastest plan: micro 1 x accum 32" in text
        assert "; a suggestion: this run uses the configured plan" in text
        assert "Configured:  micro 2 x accum 16, checkpointing all layers" in text
        assert "this run uses it (the fastest plan is 1.25x faster: set batch.micro_batch_size=auto" in text
    # One speed-up a screen (not 1.26x over the baseline beside 1.27x over the configured plan).
    assert len(re.findall(r"\d\.\d\dx", text)) == 1, text
    assert ("Predicted speed-up: 1.25x" in text) == (configured_micro == 1)


def test_a_configured_plan_that_does_not_fit_gets_no_speed_suggestion() -> None:
    """Out of memory is not a speed tip: below the table of plans that fit, nothing offers the fastest one
    (the remedies lead the screen instead)."""
    from rich.console import Console

    from zerofit.planner.plan_report import print_speed

    fastest = _option(1, 32, 28, 572.0)
    configured = {**_option(4, 8, 32, 562.0), "total_gib": 25.42, "verdict": "does not fit"}
    speed = {"rates_of": "rtx3090", "reference_rates": False, "options": [fastest], "chosen": fastest}
    speed |= {"runner_up": None, "baseline": fastest, "speedup_vs_baseline": 1.0, "configured": configured}
    console = Console(record=True, width=300)
    print_speed(speed, console)
    text = console.export_text()
    assert "Fastest plans that fit" in text
    for tip in ("Fastest plan:", "Chosen plan", "suggestion", "faster", "speed-up", "Configured"):
        assert tip not in text, text


def test_the_chooser_runs_only_on_a_config_with_no_other_problem() -> None:
    """`auto` that could not fit, beside a missing data file: the user is told about the file (the real
    problem), not "nothing fits" (the planner's candidates are resolved and would fail on the file)."""
    cfg = _cfg(
        batch={"micro_batch_size": "auto"},
        lora={"enabled": False},
        data={"path": "no/such/file.jsonl"},
        planner={"gpu": "rtx4080"},
    )
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 1, choose_fastest_plan)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(
        "data.path = 'no/such/file.jsonl'"
    )


def test_auto_checkpointing_keeps_the_configured_split_exact() -> None:
    """A fixed micro-batch with `auto` checkpointing is split as written: an accumulation that does not
    make the global batch is refused, not silently replaced."""
    cfg = _cfg(
        batch={"micro_batch_size": 4, "grad_accum_steps": 2}, train={"activation_checkpointing": "auto"}
    )
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 1, choose_fastest_plan)
    assert err.value.problems[0].startswith("batch: ") and "32" in err.value.problems[0]
    resolved = resolve(
        _cfg(
            batch={"micro_batch_size": 4, "grad_accum_steps": 8}, train={"activation_checkpointing": "auto"}
        ),
        1,
        choose_fastest_plan,
    )
    assert (resolved.batch.micro_batch_size, resolved.batch.grad_accum_steps) == (4, 8)
