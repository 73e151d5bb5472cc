"""One global batch, split exactly: global = micro-batch x accumulation steps x data-parallel size.

This module is pure arithmetic (no torch import) so `zerofit plan`, the config resolver and the tests can
use it anywhere. It never floors: a split that does not divide is refused with a message that names every
factor and lists the micro-batch sizes that would work, instead of DeepSpeed's assertion at launch or a
silently different batch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchConfigError", "BatchPlan", "BatchSplit", "solve_batch", "valid_micro_batch_sizes"]


class BatchConfigError(ValueError):
    """A batch split that cannot be satisfied exactly; the message says why and what would work."""


@dataclass(frozen=True)
class BatchSplit:
    """The exact split of one optimizer step's batch (all counts are samples, per optimizer step)."""

    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    dp_size: int

    @property
    def samples_per_rank(self) -> int:
        """Samples one data-parallel rank processes per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    def describe(self) -> str:
        """One line with every factor, e.g. `global 64 = micro 2 x accum 4 x dp 8`."""
        return (
            f"global {self.global_batch_size} = micro {self.micro_batch_size} "
            f"x accum {self.grad_accum_steps} x dp {self.dp_size}"
        )


def valid_micro_batch_sizes(global_batch_size: int, dp_size: int) -> list[int]:
    """Micro-batch sizes that split `global_batch_size` evenly over `dp_size` ranks with whole accumulation."""
    if global_batch_size <= 0 or dp_size <= 0 or global_batch_size % dp_size:
        return []
    per_rank = global_batch_size // dp_size
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def _check_positive(name: str, value: int | None, problems: list[str]) -> None:
    if value is None:
        return
    # bool is an int subclass; `True` as a batch size is always a config mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{name} must be a positive integer, got {value!r}")
    elif value <= 0:
        problems.append(f"{name} must be a positive integer, got {value}")


def _indivisible(gbs: int, mbs: int | None, gas: int | None, dp: int, why: str) -> BatchConfigError:
    factors = [f"global_batch_size={gbs}"]
    if mbs is not None:
        factors.append(f"micro_batch_size={mbs}")
    if gas is not None:
        factors.append(f"grad_accum_steps={gas}")
    factors.append(f"dp_size={dp}")
    valid = valid_micro_batch_sizes(gbs, dp)
    if valid:
        options = ", ".join(str(m) for m in valid)
        fix = (
            f"Valid micro_batch_size values for global {gbs} on {dp} rank(s): {options} "
            f"(grad_accum_steps is then {gbs // dp} / micro_batch_size)."
        )
    else:
        multiples = ", ".join(str(dp * k) for k in range(1, 5))
        fix = (
            f"No micro_batch_size works: {gbs} is not a multiple of dp_size={dp}; "
            f"choose global_batch_size as a multiple of {dp} (e.g. {multiples}, ...). "
            f"Valid micro_batch_size values: none."
        )
    return BatchConfigError(
        f"Batch split {', '.join(factors)} is not exact: {why}. "
        f"The rule is global_batch_size = micro_batch_size x grad_accum_steps x dp_size, with no rounding. {fix}"
    )


def _check_given(
    dp_size: int, global_batch_size: int | None, micro_batch_size: int | None, grad_accum_steps: int | None
) -> None:
    """Refuse what no split can come from, before any arithmetic: a non-positive value (all of them named
    in one message), or fewer than two of the three batch values (the third cannot be derived)."""
    problems: list[str] = []
    _check_positive("dp_size", dp_size, problems)
    _check_positive("global_batch_size", global_batch_size, problems)
    _check_positive("micro_batch_size", micro_batch_size, problems)
    _check_positive("grad_accum_steps", grad_accum_steps, problems)
    if problems:
        raise BatchConfigError("Invalid batch settings: " + "; ".join(problems) + ".")
    given = sum(v is not None for v in (global_batch_size, micro_batch_size, grad_accum_steps))
    if given < 2:
        raise BatchConfigError(
            "Batch settings are underdetermined: set at least two of global_batch_size, micro_batch_size, "
            f"grad_accum_steps (got global_batch_size={global_batch_size}, micro_batch_size={micro_batch_size}, "
            f"grad_accum_steps={grad_accum_steps}, dp_size={dp_size}). Usually you set global_batch_size and "
            "micro_batch_size and zerofit derives grad_accum_steps."
        )


# The name docs/contracts.md's batch API gave it before "plan" came to mean the run plan alone.
BatchPlan = BatchSplit


def solve_batch(
    dp_size: int,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
) -> BatchSplit:
    """Derive the missing factor of `global = micro x accum x dp` and check all of them.

    Any two of the three batch values plus `dp_size` determine the third; if all three are given they must
    agree. Raises `BatchConfigError` (a `ValueError`) for non-positive values, fewer than two values, or a
    split that does not divide exactly.
    """
    _check_given(dp_size, global_batch_size, micro_batch_size, grad_accum_steps)
    if global_batch_size is None:
        assert micro_batch_size is not None and grad_accum_steps is not None  # narrowed by `given >= 2`
        return BatchSplit(
            micro_batch_size * grad_accum_steps * dp_size, micro_batch_size, grad_accum_steps, dp_size
        )

    gbs = global_batch_size
    if micro_batch_size is None:
        assert grad_accum_steps is not None
        denom = grad_accum_steps * dp_size
        if gbs % denom:
            raise _indivisible(
                gbs,
                None,
                grad_accum_steps,
                dp_size,
                f"{gbs} is not divisible by {grad_accum_steps} x {dp_size} = {denom}",
            )
        return BatchSplit(gbs, gbs // denom, grad_accum_steps, dp_size)

    denom = micro_batch_size * dp_size
    if gbs % denom:
        raise _indivisible(
            gbs, micro_batch_size, grad_accum_steps, dp_size,
            f"{gbs} is not divisible by micro_batch_size x dp_size = {micro_batch_size} x {dp_size} = {denom}",
        )  # fmt: skip
    derived_gas = gbs // denom
    if grad_accum_steps is not None and grad_accum_steps != derived_gas:
        raise _indivisible(
            gbs, micro_batch_size, grad_accum_steps, dp_size,
            f"{micro_batch_size} x {grad_accum_steps} x {dp_size} = {micro_batch_size * grad_accum_steps * dp_size}, not {gbs} "
            f"(grad_accum_steps would have to be {derived_gas})",
        )  # fmt: skip
    return BatchSplit(gbs, micro_batch_size, derived_gas, dp_size)
