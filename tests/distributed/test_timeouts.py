"""Long rank-0-only work outlasts the process-group timeout without killing the run; timed saves agree.

One 2-rank DDP launch (torchrun, gloo) with `distributed.timeout_minutes` = 0.2 (12 s): rank 0's data
loading is delayed 20 s (the fault-injection variable `ZEROFIT_FAULT_DELAY_RANK0_DATA_S`, as a long
tokenization would be). Rank 1 waits for it through the c10d store (`Strategy.wait_for_rank0`); waiting
inside the broadcast that follows, as before, gloo aborts after 12 s ("Timed out waiting ... for recv").
(The delay exceeds the timeout by 8 s, more than the two ranks' start-up can differ by; both are short
because the delay is idle time of the whole suite: the two cores wait while this launch sleeps.)
The same launch saves on a wall-clock interval (`checkpoint.every_minutes` of a fraction of a second):
only rank 0's clock decides, through the loop's after-step all-reduce, so both ranks enter the same
collective saves and the run finishes with several timed checkpoints.
"""

from __future__ import annotations

import pytest

from launch_helpers import Launch, RunResult, run_launches, write_config
from zerofit.checkpoint import complete_checkpoints
from zerofit.recipe.assembly import FAULT_DELAY_DATA_ENV

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_MINUTES, DELAY_S, STEPS = 0.2, 20, 6


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    root = tmp_path_factory.mktemp("timeouts")
    config = write_config(
        root / "timeouts.yaml",
        {
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "distributed": {"strategy": "ddp", "timeout_minutes": TIMEOUT_MINUTES},
            "train": {"max_steps": STEPS, "precision": "fp32"},
            "data": {"path": "data/demo.jsonl", "max_seq_len": 64},
            "checkpoint": {"every_minutes": 0.001, "keep_last": STEPS},  # due after 0.06 s: most steps
            "logging": {"wandb": {"mode": "disabled"}},
        },
    )
    launch = Launch("slow-rank0", "torchrun", env={FAULT_DELAY_DATA_ENV: str(DELAY_S)})
    return run_launches([launch], config, root / "runs")["slow-rank0"]


def test_a_rank_0_job_longer_than_the_timeout_does_not_kill_the_run(run: RunResult) -> None:
    run.check()
    assert f"collectives wait {TIMEOUT_MINUTES:g} min for a peer (distributed.timeout_minutes)" in run.stdout
    assert run.seconds > DELAY_S and len(run.metrics) == STEPS


def test_timed_saves_are_taken_by_every_rank_at_the_same_steps(run: RunResult) -> None:
    run.check()
    steps = [step for step, _ in complete_checkpoints(run.run_dir)]
    assert steps[-1] == STEPS and len(steps) >= 3, steps  # timed saves besides the final one
    for step in steps:  # both ranks wrote their part of every one (a disagreement would hang the save)
        assert {p.name for p in (run.run_dir / "checkpoints" / f"step-{step}").glob("rng-rank*.pt")} == {
            "rng-rank0.pt",
            "rng-rank1.pt",
        }
