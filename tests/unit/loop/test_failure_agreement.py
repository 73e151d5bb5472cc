"""`agree_on_failure`: a user error raised on any rank is raised on every rank, as its own class with the
failing rank's paragraph, and marked agreed so the launcher says it once (rank 0). Two ranks run here as two
threads whose collectives exchange their values through a barrier, as a process group's would."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from zerofit.core.errors import ConfigError, DataError, ZerofitError
from zerofit.loop.rollout import RewardFailed, agree_on_failure
from zerofit.recipe.run import prints_error
from zerofit.strategies.env import LaunchEnv


class _Exchange:
    """What two ranks' collectives share: each puts its value in, both read every rank's."""

    def __init__(self) -> None:
        self.values: list[Any] = [None, None]
        self.barrier = threading.Barrier(2, timeout=30)

    def both(self, rank: int, value: Any) -> list[Any]:
        self.values[rank] = value
        self.barrier.wait()
        seen = list(self.values)
        self.barrier.wait()  # nobody overwrites a value before both have read it
        return seen


class _RankOfTwo:
    """The two collectives `agree_on_failure` calls, for one rank of two."""

    device = torch.device("cpu")

    def __init__(self, rank: int, exchange: _Exchange) -> None:
        self.rank, self.exchange = rank, exchange

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return sum(self.exchange.both(self.rank, tensor), torch.zeros_like(tensor))

    def all_gather_object(self, value: Any) -> list[Any]:
        return self.exchange.both(self.rank, value)


def _agree(
    failures: tuple[str | ZerofitError | None, str | ZerofitError | None],
) -> list[BaseException | None]:
    """What each of two ranks raised from `agree_on_failure` with its own failure (None: returned)."""
    exchange, raised = _Exchange(), [None, None]

    def rank(r: int) -> None:
        try:
            agree_on_failure(_RankOfTwo(r, exchange), failures[r])  # type: ignore[arg-type]
        except BaseException as exc:
            raised[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return raised  # type: ignore[return-value]


TOOL = "rl.tools[0].function = 'my_tools:add': importing module 'my_tools' raised OSError: x; fix the module"


def test_a_config_error_on_one_rank_is_raised_by_both_and_said_by_rank_0_only() -> None:
    raised = _agree((None, ConfigError([TOOL])))
    assert all(isinstance(exc, ConfigError) and exc.problems == [TOOL] for exc in raised), raised
    assert [str(exc) for exc in raised] == [f"Invalid configuration: {TOOL}"] * 2
    envs = [LaunchEnv(rank=r, world_size=2, local_rank=r, launched=True) for r in (0, 1)]
    said = [prints_error(exc, env, from_config=False) for exc, env in zip(raised, envs, strict=True)]  # type: ignore[arg-type]
    assert said == [True, False]


def test_when_both_ranks_fail_the_first_ranks_error_is_the_one_said() -> None:
    raised = _agree((DataError("data record 3: too long"), ConfigError([TOOL])))
    assert all(type(exc) is DataError and str(exc) == "data record 3: too long" for exc in raised), raised
    assert all(exc is not None and exc.agreed for exc in raised)  # type: ignore[union-attr]


def test_a_paragraph_is_raised_as_the_given_error_and_no_failure_raises_nothing() -> None:
    raised = _agree(("reward digits failed at step 1", None))
    assert all(isinstance(exc, RewardFailed) and exc.agreed for exc in raised), raised
    assert _agree((None, None)) == [None, None]


@pytest.mark.parametrize("error", [ConfigError(["a", "b"]), DataError("data.path: line 2")])
def test_one_process_raises_its_own_error_agreed(error: ZerofitError) -> None:
    from config_helpers import one_process_strategy

    with pytest.raises(type(error)) as err:
        agree_on_failure(one_process_strategy(), error)
    assert str(err.value) == str(error) and err.value.agreed
