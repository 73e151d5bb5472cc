"""A user's own DeepSpeed file (`distributed.ds_config`): HF-style `"auto"` filled from the resolved config,
hard-coded disagreements refused with both values and the fix, and DeepSpeed accepts what comes out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _deepspeed_world import deepspeed_config_at

from zerofit.config import load_config
from zerofit.core.errors import ConfigError
from zerofit.engine_spec import render_spec
from zerofit.engine_spec.user_ds_config import filled_user_ds_config
from zerofit.planner import choose_fastest_plan
from zerofit.resolution import ResolvedConfig, resolve

REPO = Path(__file__).resolve().parents[3]


def ds_config_problems(resolved: ResolvedConfig) -> list[str]:
    """Every problem the filler finds with the user's file ([] when it renders)."""
    try:
        filled_user_ds_config(resolved)
    except ConfigError as exc:
        return exc.problems
    return []


# The HF Trainer's documented ZeRO-3 example, "auto" everywhere it allows.
HF_ZERO3: dict[str, Any] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _resolved(
    tmp_path: Path, body: dict[str, Any] | str, *overrides: str, world_size: int = 2
) -> ResolvedConfig:
    path = tmp_path / "ds.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [
            f"distributed.ds_config={path}",
            "distributed.preset=null",
            f"data.path={REPO / 'data' / 'demo.jsonl'}",
            *overrides,
        ],
    )
    return resolve(cfg, world_size, choose_fastest_plan)


def _with(**changes: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(HF_ZERO3))
    for dotted, value in changes.items():
        node = body
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return body


def _has_auto(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_has_auto(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_auto(v) for v in node)
    return node == "auto"


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_every_auto_is_filled_and_deepspeed_accepts_it(tmp_path: Path, dp: int, precision: str) -> None:
    resolved = _resolved(
        tmp_path,
        HF_ZERO3,
        "batch.global_batch_size=32",
        "batch.micro_batch_size=2",
        f"train.precision={precision}",
        "optimizer.betas=[0.9,0.95]",
        "optimizer.weight_decay=0.1",
        "scheduler.warmup_steps=0",
        world_size=dp,
    )
    assert ds_config_problems(resolved) == []
    rendered = render_spec(resolved).to_json()
    assert not _has_auto(rendered)
    plan = resolved.batch
    assert rendered["train_batch_size"] == 32
    assert rendered["train_micro_batch_size_per_gpu"] == 2
    assert rendered["gradient_accumulation_steps"] == plan.grad_accum_steps == 32 // (2 * dp)
    assert rendered["gradient_clipping"] == 1.0
    assert rendered["fp16"]["enabled"] is (precision == "fp16")
    assert rendered["bf16"]["enabled"] is (precision == "bf16")
    assert rendered["optimizer"]["params"] == {
        "lr": 3e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert rendered["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-3,
        "warmup_num_steps": 1,  # DeepSpeed refuses 0; the HF Trainer fills max(1, warmup) too
        "total_num_steps": resolved.config.train.max_steps,
    }
    zero = rendered["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (64 * 64, int(0.9 * 64 * 64))
    assert zero["stage3_param_persistence_threshold"] == 640
    assert rendered["steps_per_print"] == 2000  # the user's own choice is kept
    assert rendered["tensorboard"] == {"enabled": False}

    ds = deepspeed_config_at(rendered, dp)
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
        32,
        2,
        plan.grad_accum_steps,
    )
    assert ds.zero_optimization_stage == 3 and ds.optimizer_name == "adamw"
    assert ds.scheduler_name == "WarmupDecayLR"


def test_hard_coded_batch_that_disagrees_is_refused_with_both_values(tmp_path: Path) -> None:
    body = _with(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    resolved = _resolved(tmp_path, body)  # demo: global 16 = micro 4 x accum 2 x dp 2
    problems = ds_config_problems(resolved)
    assert len(problems) == 1
    msg = problems[0]
    assert "train_batch_size = 32" in msg and "train_batch_size = 16" in msg
    assert "global 16 = micro 4 x accum 2 x dp 2" in msg and "world size 2" in msg
    assert '"train_batch_size": "auto"' in msg and "batch.global_batch_size=32" in msg
    with pytest.raises(ConfigError) as err:
        render_spec(resolved).to_json()
    assert err.value.problems == problems


def test_hard_coded_values_that_agree_are_fine(tmp_path: Path) -> None:
    body = _with(
        train_batch_size=16,
        train_micro_batch_size_per_gpu=4,
        gradient_accumulation_steps=2,
        gradient_clipping=1,
        bf16__enabled=True,
        fp16__enabled=False,
        optimizer__params__lr=0.003,
        optimizer__params__betas=[0.9, 0.999],
    )
    resolved = _resolved(tmp_path, body)
    assert ds_config_problems(resolved) == []
    assert render_spec(resolved).to_json()["train_batch_size"] == 16


def test_missing_batch_keys_are_written_from_the_plan(tmp_path: Path) -> None:
    body = {"zero_optimization": {"stage": 1}}
    rendered = render_spec(_resolved(tmp_path, body, world_size=4)).to_json()
    assert (rendered["train_batch_size"], rendered["train_micro_batch_size_per_gpu"]) == (16, 4)
    assert rendered["gradient_accumulation_steps"] == 1
    assert rendered["bf16"] == {"enabled": True} and rendered["zero_allow_untested_optimizer"] is True
    assert rendered["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 4096}


def test_bf16_and_fp16_both_enabled(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, _with(fp16__enabled=True, bf16__enabled=True)))
    assert len(problems) == 1 and "enables both fp16 and bf16" in problems[0]


def test_precision_that_disagrees_with_train_precision(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, _with(fp16__enabled=True)))  # demo: bf16
    assert len(problems) == 1
    assert "enables fp16" in problems[0] and "train.precision = 'bf16'" in problems[0]
    assert "train.precision=fp16" in problems[0]
    problems = ds_config_problems(_resolved(tmp_path, _with(bf16__enabled=False)))
    assert len(problems) == 1 and "disables bf16" in problems[0]


def test_legacy_bfloat16_key_is_understood(tmp_path: Path) -> None:
    body = _with(bf16=None, bfloat16={"enabled": True}, fp16=None)
    rendered = render_spec(_resolved(tmp_path, body)).to_json()
    assert rendered["bf16"] == {"enabled": True} and "bfloat16" not in rendered


def test_hard_coded_lr_that_disagrees(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, _with(optimizer__params__lr=3e-5)))
    assert len(problems) == 1
    assert "optimizer.params.lr = 3e-05" in problems[0] and "optimizer.lr=3e-05" in problems[0]


def test_hard_coded_schedule_length_that_disagrees(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, _with(scheduler__params__total_num_steps=1000)))
    assert len(problems) == 1 and "train.max_steps=1000" in problems[0]


def test_auto_that_zerofit_cannot_fill(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, _with(zero_optimization__stage="auto")))
    assert len(problems) == 1
    assert 'zero_optimization.stage = "auto"' in problems[0] and "no value to fill it with" in problems[0]


def test_optimizer_block_with_a_client_optimizer_name(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, HF_ZERO3, "optimizer.name=adamw_8bit"))
    assert len(problems) == 1
    assert (
        "optimizer.name = 'adamw_8bit'" in problems[0] and "delete the file's optimizer block" in problems[0]
    )
    problems = ds_config_problems(_resolved(tmp_path, _with(optimizer__type="Lamb")))
    assert len(problems) == 1 and "'Lamb'" in problems[0]


def test_file_without_optimizer_block_follows_the_preset_rules(tmp_path: Path) -> None:
    body = _with(optimizer=None, scheduler=None)
    rendered = render_spec(_resolved(tmp_path, body)).to_json()
    assert rendered["optimizer"]["type"] == "AdamW"  # optimizer offload + adamw: DeepSpeed's CPU Adam
    rendered = render_spec(_resolved(tmp_path, body, "optimizer.name=paged_adamw_8bit")).to_json()
    assert "optimizer" not in rendered and rendered["zero_force_ds_cpu_optimizer"] is False


def test_all_conflicts_are_reported_together(tmp_path: Path) -> None:
    body = _with(
        train_micro_batch_size_per_gpu=8, fp16__enabled=True, bf16__enabled=True, gradient_clipping=0.5
    )
    problems = ds_config_problems(_resolved(tmp_path, body))
    assert len(problems) == 3
    with pytest.raises(ConfigError, match=r"\(3 problems\)"):
        filled_user_ds_config(_resolved(tmp_path, body))


def test_invalid_json_and_non_object(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, '{"train_batch_size": 16,\n  oops}'))
    assert len(problems) == 1 and "not valid JSON at line 2" in problems[0]
    problems = ds_config_problems(_resolved(tmp_path, "[1, 2]"))
    assert "must hold a JSON object" in problems[0]


def test_no_foreign_file_means_no_problems(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "demo.yaml", [f"data.path={REPO / 'data' / 'demo.jsonl'}"])
    assert ds_config_problems(resolve(cfg, 1)) == []


# --------------------------------------------------------------- micro_batch_size=auto with the user's file


def _auto(tmp_path: Path, body: dict[str, Any] | str) -> ResolvedConfig:
    return _resolved(tmp_path, body, "batch.micro_batch_size=auto", "planner.gpu=rtx3090")


def test_auto_micro_batch_plans_the_users_file_and_fills_the_split(tmp_path: Path) -> None:
    resolved = _auto(tmp_path, HF_ZERO3)
    rendered = render_spec(resolved).to_json()
    assert (
        rendered["train_micro_batch_size_per_gpu"] == resolved.batch.micro_batch_size == 8
    )  # demo: 16 / dp 2
    assert rendered["zero_optimization"]["stage"] == 3


def test_auto_micro_batch_refuses_a_file_that_pins_the_split(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lets the planner choose the split") as err:
        _auto(tmp_path, _with(train_micro_batch_size_per_gpu=4))
    assert "batch.micro_batch_size=4" in str(err.value)


def test_auto_micro_batch_with_a_malformed_file_is_an_error_not_a_guess(tmp_path: Path) -> None:
    # The planner reads the engine through the same rendering as the run: a broken file is never planned
    # as if it were empty.
    with pytest.raises(ConfigError, match="not valid JSON"):
        _auto(tmp_path, '{"zero_optimization": {"stage": 3,}}')


# ----------------------------------------------------------------------------------------- scheduler block


def test_a_scheduler_block_is_honoured_and_the_plan_says_so(tmp_path: Path) -> None:
    spec = render_spec(_resolved(tmp_path, HF_ZERO3, "scheduler.warmup_steps=5"))
    assert spec.engine_scheduler == "WarmupDecayLR"  # the strategy passes no scheduler of its own
    params = spec.to_json()["scheduler"]["params"]
    assert params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-3,
        "warmup_num_steps": 5,
        "total_num_steps": 300,
    }
    described = spec.describe_schedule("cosine", 5)
    assert (
        described.startswith("DeepSpeed WarmupDecayLR schedule from ") and "'cosine' is not used" in described
    )


def test_without_a_scheduler_block_zerofit_schedules(tmp_path: Path) -> None:
    spec = render_spec(_resolved(tmp_path, _with(scheduler=None)))
    assert spec.engine_scheduler is None and "scheduler" not in spec.to_json()
    assert spec.describe_schedule("cosine", 10) == "cosine schedule, warmup 10"


def test_warmup_cosine_autos_follow_min_lr_ratio(tmp_path: Path) -> None:
    body = _with(
        scheduler={
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": "auto", "warmup_num_steps": "auto", "cos_min_ratio": "auto"},
        }
    )
    spec = render_spec(_resolved(tmp_path, body, "scheduler.min_lr_ratio=0.1"))
    assert spec.to_json()["scheduler"]["params"]["cos_min_ratio"] == 0.1


def test_a_scheduler_deepspeed_does_not_know_is_refused(tmp_path: Path) -> None:
    problems = ds_config_problems(_resolved(tmp_path, _with(scheduler={"type": "CosineAnnealing"})))
    assert len(problems) == 1
    assert "scheduler block of type 'CosineAnnealing'" in problems[0] and "WarmupDecayLR" in problems[0]
    assert "delete the block" in problems[0]
