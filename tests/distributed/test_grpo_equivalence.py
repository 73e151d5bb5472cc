"""GRPO with one global batch of rollouts, any split, any engine: one curve.

The tiny Llama in fp32 (full fine-tuning), 2 prompts x G 4 = 8 completions per step of at most 4 tokens,
`rl.num_iterations: 2` (the old policy's log-probs kept), the user's own reward function (a module on
PYTHONPATH), 4 steps, the one-process references through the Python API (`zerofit.train`, in the test
process), the first runs of each engine through `torchrun` (gloo), the rest of the matrix `warm` (tests/warm_launch.py):

    launch          launcher   engine              split (micro x accum x dp)   what
    single          api        one process         8 x 1 x 1                   the reference curve
    zero2           torchrun   DeepSpeed ZeRO-2    2 x 2 x 2                   SIGTERM mid-run, then resumed
    zero2-resumed   warm       DeepSpeed ZeRO-2    2 x 2 x 2                   zero2 resumed
    fsdp            torchrun   FSDP2               1 x 4 x 2                   layers gathered once per rollout
    *-single        api        one process         8 x 1 x 1                   LOSS's reference curve
    *-zero2         warm       DeepSpeed ZeRO-2    2 x 2 x 2                   LOSS
    *-fsdp          warm       FSDP2               1 x 4 x 2                   LOSS
    *-single        api        one process         8 x 1 x 1                   EST's reference curve, 2 steps
    *-split         api        one process         2 x 4 x 1                   EST
    *-zero2         warm       DeepSpeed ZeRO-2    2 x 2 x 2                   EST
    *-fsdp          warm       FSDP2               1 x 4 x 2                   EST

(the first four with `rl.loss_type` dapo, the default; LOSS-* for each of the other loss types, grpo and
dr_grpo; EST-* for each other estimator, 2 steps: rloo (`train.objective: rloo`, `rl.num_iterations: 1`)
and gspo (`rl.importance_sampling_level: sequence` with `rl.loss_type: grpo`, the paper's); no DeepSpeed
launch under the `deepspeed` runner: its own start-up is test_engines' and test_stop_resume's)

Each rank samples its own completions, seeded per (seed, step, global completion index), and the advantages
come from whole groups (a group's 4 completions land on both ranks here): the per-step loss, grad norm,
reward and completion lengths agree within 2e-5.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from launch_helpers import Launch, RunResult, max_difference, metric_rows, run_launches, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, TOL = 4, 2e-5
MODULE = "zerofit_launch_toy_rewards"
CURVES = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy", "clip_ratio")
Z2 = ("distributed.strategy=deepspeed", "distributed.preset=zero2", "batch.micro_batch_size=2")
LAUNCHES = [
    Launch("single", "api", ("distributed.strategy=single", "batch.micro_batch_size=8")),
    Launch("zero2", "torchrun", Z2, interrupt=(signal.SIGTERM, "group", 2)),
    Launch("fsdp", "torchrun", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
]
OTHER_LOSSES = ("grpo", "dr_grpo")
LAUNCHES += [
    Launch(f"{loss}-{name}", launcher, (*args, f"rl.loss_type={loss}"))
    for loss in OTHER_LOSSES
    for name, launcher, args in (
        ("single", "api", ("distributed.strategy=single", "batch.micro_batch_size=8")),
        ("zero2", "warm", Z2),
        ("fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
    )
]
ESTIMATORS = {
    "rloo": ("train.objective=rloo", "rl.num_iterations=1"),  # TRL's default: a second update clips all here
    "gspo": ("rl.importance_sampling_level=sequence", "rl.loss_type=grpo"),
}
ESTIMATOR_STEPS = 2
SPLITS = (
    ("single", "api", ("distributed.strategy=single", "batch.micro_batch_size=8")),
    ("split", "api", ("distributed.strategy=single", "batch.micro_batch_size=2")),
    ("zero2", "warm", Z2),
    ("fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
)
LAUNCHES += [
    Launch(f"{est}-{name}", launcher, (*args, *overrides, f"train.max_steps={ESTIMATOR_STEPS}"))
    for est, overrides in ESTIMATORS.items()
    for name, launcher, args in SPLITS
]
RESUMED = Launch("zero2", "warm", (*Z2, "checkpoint.resume=true"), key="zero2-resumed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("grpo")
    (root / f"{MODULE}.py").write_text(
        "def digits(prompts, completions, columns):\n"
        "    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n"
    )
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"item {i}{'?' * (i % 4)}: "}) + "\n" for i in range(16))
    )
    config = write_config(
        root / "grpo.yaml",
        {
            "seed": 3,
            "model": {"name_or_path": "tiny-llama"},
            "train": {"objective": "grpo", "max_steps": STEPS, "precision": "fp32", "max_grad_norm": 1.0},
            "optimizer": {"lr": 3e-3},
            "scheduler": {"name": "constant"},
            "lora": {"enabled": False},
            "rl": {
                "num_generations": 4,
                "prompts_per_step": 2,
                "max_completion_length": 4,
                "num_iterations": 2,
                "rewards": [{"function": f"{MODULE}:digits"}],
                "log_completions_every": 1,
            },
            "data": {"path": str(prompts)},
            "checkpoint": {"every_minutes": 0},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    env = {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    results = run_launches(LAUNCHES, config, root / "runs", env=env)
    results.update(run_launches([RESUMED], config, root / "runs", env=env))
    for key, result in results.items():
        if key != "zero2":  # the interrupted segment ends by its signal
            result.check()
    return results


@pytest.mark.parametrize(
    "name",
    ["zero2-resumed", "fsdp", *(f"{loss}-{engine}" for loss in OTHER_LOSSES for engine in ("zero2", "fsdp"))],
)
def test_one_grpo_curve_for_every_engine_and_split(runs: dict[str, RunResult], name: str) -> None:
    """Each loss type's curve (dapo: the unprefixed launches) on 2 ranks is its one-process curve."""
    loss = next((loss for loss in OTHER_LOSSES if name.startswith(loss + "-")), None)
    run, base = runs[name], runs["single" if loss is None else f"{loss}-single"]
    assert [row["step"] for row in run.metrics] == list(range(1, STEPS + 1))
    a, b = metric_rows(run, CURVES), metric_rows(base, CURVES)
    assert max_difference(a, b) < TOL, (
        a,
        b,
    )
    assert run.series("tokens") == base.series("tokens")
    assert (run.metrics[-1]["micro_batch_size"], run.metrics[-1]["dp_size"]) == (
        2 if "zero2" in name else 1,
        2,
    )
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert saved["rl"]["loss_type"] == (loss or "dapo")


def test_the_loss_types_give_different_curves(runs: dict[str, RunResult]) -> None:
    """The loss-type launches ran their own normalizers: the same rollouts, another loss."""
    losses = [runs[name].series("loss") for name in ("single", "grpo-single", "dr_grpo-single")]
    assert losses[0] != losses[1] and losses[0] != losses[2] and losses[1] != losses[2], losses


def test_sigterm_mid_run_then_resume_and_the_completions_file(runs: dict[str, RunResult]) -> None:
    stopped, resumed = runs["zero2"], runs["zero2-resumed"]
    assert "resume with the same command plus checkpoint.resume=true" in stopped.stdout
    assert "resumed from" in resumed.stdout
    assert abs(runs["single"].metrics[-1]["grad_norm"]) > 0  # the curves compared are of real updates
    rows = [
        json.loads(line) for line in (runs["fsdp"].run_dir / "completions.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows][:1] == [1] and {"prompt", "completion", "reward"} <= set(rows[0])


@pytest.mark.parametrize(
    "name", [f"{est}-{split}" for est in ESTIMATORS for split in ("split", "zero2", "fsdp")]
)
def test_one_curve_per_estimator_for_every_engine_and_split(runs: dict[str, RunResult], name: str) -> None:
    """RLOO's and GSPO's curves on one process 2 x 4 and on 2 ranks are their one-process 8 x 1 curve, and
    each is its own: another loss than GRPO's (dapo) on the same first rollout."""
    est = name.split("-")[0]
    run, base = runs[name], runs[f"{est}-single"]
    assert [row["step"] for row in run.metrics] == list(range(1, ESTIMATOR_STEPS + 1))
    a, b = metric_rows(run, CURVES), metric_rows(base, CURVES)
    assert max_difference(a, b) < TOL, (
        a,
        b,
    )
    assert run.metrics[0]["reward"] == runs["single"].metrics[0]["reward"]  # the same first rollout
    assert base.series("loss")[0] != runs["single"].series("loss")[0]
    assert max(base.series("grad_norm")) > 0  # real updates (a step whose groups all tie has none)
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    assert (saved["train"]["objective"], saved["rl"]["importance_sampling_level"]) == (
        ("rloo", "token") if est == "rloo" else ("grpo", "sequence")
    )
