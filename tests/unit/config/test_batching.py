"""`zerofit.config.batching`: one global batch split exactly, refused with every factor named, never floored.

Property tests (hypothesis) cover the arithmetic; DeepSpeed's own `DeepSpeedConfig` is the referee for
"the same triple at the same data-parallel size" and for refusing the same splits.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _deepspeed_world import deepspeed_config_at
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofit.config.batching import BatchConfigError, BatchSplit, solve_batch, valid_micro_batch_sizes

dp_sizes = st.integers(min_value=1, max_value=64)
factors = st.integers(min_value=1, max_value=64)
sizes = st.integers(min_value=1, max_value=4096)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _expected_valid_text(gbs: int, dp: int) -> str:
    if gbs % dp:
        return "Valid micro_batch_size values: none"
    return ", ".join(str(m) for m in _divisors(gbs // dp))


@given(dp=dp_sizes, micro=factors, gas=factors)
def test_any_two_of_three_determine_the_third(dp: int, micro: int, gas: int) -> None:
    gbs = micro * gas * dp
    expected = BatchSplit(gbs, micro, gas, dp)
    assert solve_batch(dp, global_batch_size=gbs, micro_batch_size=micro) == expected
    assert solve_batch(dp, global_batch_size=gbs, grad_accum_steps=gas) == expected
    assert solve_batch(dp, micro_batch_size=micro, grad_accum_steps=gas) == expected
    assert solve_batch(dp, gbs, micro, gas) == expected
    assert expected.samples_per_rank == micro * gas
    assert expected.describe() == f"global {gbs} = micro {micro} x accum {gas} x dp {dp}"


@given(dp=dp_sizes, gbs=sizes, micro=st.none() | factors, gas=st.none() | factors)
def test_every_returned_plan_is_exact(dp: int, gbs: int, micro: int | None, gas: int | None) -> None:
    if micro is None and gas is None:
        micro = 1
    try:
        plan = solve_batch(dp, gbs, micro, gas)
    except BatchConfigError:
        return
    assert plan.global_batch_size == plan.micro_batch_size * plan.grad_accum_steps * plan.dp_size == gbs
    assert plan.dp_size == dp
    if micro is not None:
        assert plan.micro_batch_size == micro
    if gas is not None:
        assert plan.grad_accum_steps == gas


@given(dp=dp_sizes, gbs=sizes, micro=factors)
def test_indivisible_micro_split_names_every_factor_and_valid_sizes(dp: int, gbs: int, micro: int) -> None:
    if gbs % (micro * dp) == 0:
        assert solve_batch(dp, gbs, micro).grad_accum_steps == gbs // (micro * dp)
        return
    with pytest.raises(BatchConfigError) as err:
        solve_batch(dp, gbs, micro)
    msg = str(err.value)
    for text in (f"global_batch_size={gbs}", f"micro_batch_size={micro}", f"dp_size={dp}"):
        assert text in msg
    assert _expected_valid_text(gbs, dp) in msg


@given(dp=dp_sizes, gbs=sizes, gas=factors)
def test_indivisible_accumulation_split_names_every_factor(dp: int, gbs: int, gas: int) -> None:
    if gbs % (gas * dp) == 0:
        assert solve_batch(dp, gbs, grad_accum_steps=gas).micro_batch_size == gbs // (gas * dp)
        return
    with pytest.raises(BatchConfigError) as err:
        solve_batch(dp, gbs, grad_accum_steps=gas)
    msg = str(err.value)
    for text in (f"global_batch_size={gbs}", f"grad_accum_steps={gas}", f"dp_size={dp}"):
        assert text in msg
    assert _expected_valid_text(gbs, dp) in msg


@given(dp=dp_sizes, micro=factors, gas=factors, delta=st.integers(min_value=1, max_value=8))
def test_three_values_that_disagree_are_refused(dp: int, micro: int, gas: int, delta: int) -> None:
    gbs = micro * (gas + delta) * dp  # divisible, but not with this grad_accum_steps
    with pytest.raises(BatchConfigError) as err:
        solve_batch(dp, gbs, micro, gas)
    msg = str(err.value)
    for text in (
        f"global_batch_size={gbs}",
        f"micro_batch_size={micro}",
        f"grad_accum_steps={gas}",
        f"dp_size={dp}",
    ):
        assert text in msg
    assert f"grad_accum_steps would have to be {gas + delta}" in msg


def test_acceptance_example_lists_valid_micro_sizes() -> None:
    with pytest.raises(BatchConfigError) as err:
        solve_batch(8, global_batch_size=64, micro_batch_size=3)
    msg = str(err.value)
    assert "global_batch_size=64" in msg and "micro_batch_size=3" in msg and "dp_size=8" in msg
    assert "1, 2, 4, 8" in msg
    assert valid_micro_batch_sizes(64, 8) == [1, 2, 4, 8]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"global_batch_size": 64},
        {"micro_batch_size": 2},
        {"grad_accum_steps": 4},
        {},
    ],
)
def test_fewer_than_two_values_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(BatchConfigError, match="set at least two of") as err:
        solve_batch(2, **kwargs)
    for name in ("global_batch_size", "micro_batch_size", "grad_accum_steps", "dp_size=2"):
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("dp", "kwargs", "named"),
    [
        (0, {"global_batch_size": 8, "micro_batch_size": 1}, "dp_size must be a positive integer, got 0"),
        (
            1,
            {"global_batch_size": 0, "micro_batch_size": 1},
            "global_batch_size must be a positive integer, got 0",
        ),
        (
            1,
            {"global_batch_size": 8, "micro_batch_size": -2},
            "micro_batch_size must be a positive integer, got -2",
        ),
        (
            1,
            {"global_batch_size": 8, "grad_accum_steps": 0},
            "grad_accum_steps must be a positive integer, got 0",
        ),
        (
            1,
            {"global_batch_size": 8, "micro_batch_size": True},
            "micro_batch_size must be a positive integer, got True",
        ),
        (
            1,
            {"global_batch_size": 8.0, "micro_batch_size": 2},
            "global_batch_size must be a positive integer, got 8.0",
        ),
    ],
)
def test_non_positive_or_non_integer_values_are_refused(dp: int, kwargs: dict, named: str) -> None:
    with pytest.raises(BatchConfigError) as err:
        solve_batch(dp, **kwargs)
    assert named in str(err.value)


def test_batching_does_not_import_torch() -> None:
    code = "import sys, zerofit.config.batching; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ------------------------------------------------------------------ DeepSpeed's own derivation as referee


@settings(max_examples=60, deadline=None)
@given(dp=st.sampled_from([1, 2, 8]), micro=st.integers(1, 16), gas=st.integers(1, 16))
def test_deepspeed_derives_the_same_triple_at_the_same_dp(dp: int, micro: int, gas: int) -> None:
    plan = solve_batch(dp, global_batch_size=micro * gas * dp, micro_batch_size=micro)
    full = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
    }
    # Each pair DeepSpeed can be given: it must derive our third value, and the full triple must pass.
    for dropped in (*full, None):
        given_keys = {k: v for k, v in full.items() if k != dropped}
        ds = deepspeed_config_at(given_keys, dp)
        assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
            plan.global_batch_size,
            plan.micro_batch_size,
            plan.grad_accum_steps,
        )


@settings(max_examples=60, deadline=None)
@given(dp=st.sampled_from([1, 2, 8]), gbs=st.integers(1, 256), micro=st.integers(1, 32))
def test_deepspeed_refuses_exactly_the_splits_zerofit_refuses(dp: int, gbs: int, micro: int) -> None:
    try:
        plan = solve_batch(dp, global_batch_size=gbs, micro_batch_size=micro)
    except BatchConfigError:
        plan = None
    config = {"train_batch_size": gbs, "train_micro_batch_size_per_gpu": micro}
    if plan is None:
        # DeepSpeed floors the accumulation steps, then its own consistency assertion fires.
        with pytest.raises(AssertionError):
            deepspeed_config_at(config, dp)
    else:
        assert deepspeed_config_at(config, dp).gradient_accumulation_steps == plan.grad_accum_steps
