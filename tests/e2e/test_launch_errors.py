"""Bad input to `launchers/launch_finetune.py`: exit code 2, one clear paragraph, no traceback, and nothing
written into an earlier run's directory (each bad launch reuses that run's output_dir and run_name).

Batch problems must be caught before any model is loaded: those launches get an empty model cache, which
must still be empty afterwards (the built-in tiny model is written there on first load). A control launch
that does get as far as the tokenizer (bad data) gets an empty cache too, which must be filled: the cache
the others leave empty is really the one a load would write.

    launch                    launcher    what
    earlier                   api         the earlier run whose directory the bad launches must not touch
    earlier                   python      a new run with the taken name: it gets its own directory
    indivisible-2-ranks       deepspeed   a global batch 2 ranks cannot split (refused before the model)
    indivisible               python      a global batch the micro-batch cannot divide
    multi-rank-under-python   python      a multi-rank split started under plain `python`
    unknown-*                 python      an unknown strategy, an unknown preset
    *-data                    python      missing, empty and malformed data files
    truncated-away            python      every example cut to nothing by data.max_seq_len
    output-dir-is-a-file      python      output_dir names a file
    nothing-to-resume         python      checkpoint.resume with no checkpoint to resume
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch_helpers import Launch, RunResult, run_launches, run_one, write_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

RUN = "earlier"


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    good = root / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"q{i}: ", "response": f"a{i}"}) + "\n" for i in range(8)))
    (root / "empty.jsonl").write_text("")
    lines = good.read_text().splitlines()
    (root / "malformed.jsonl").write_text(
        "\n".join([*lines[:2], '{"prompt": "x", "response": ', *lines[2:]]) + "\n"
    )
    long_prompts = "".join(json.dumps({"prompt": "p" * 40, "response": "r"}) + "\n" for _ in range(8))
    (root / "long.jsonl").write_text(long_prompts)
    (root / "a-file").write_text("not a folder")
    config = write_config(
        root / "base.yaml",
        {
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "distributed": {"strategy": "single"},
            "train": {"max_steps": 1, "precision": "fp32"},
            "data": {"path": str(good), "max_seq_len": 32},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    out = root / "runs"
    run_one(Launch(RUN, "api"), config, out).check()  # the earlier run: through the API, in this process
    return {"root": root, "config": config, "out": out}


BAD = {
    # name: (launcher, overrides, text the message must contain)
    "indivisible": ("python", ("batch.micro_batch_size=3",), "Valid micro_batch_size values"),
    "indivisible-2-ranks": (
        "deepspeed",
        ("distributed.strategy=deepspeed", "batch.global_batch_size=6", "batch.micro_batch_size=2"),
        "dp_size=2",
    ),
    "multi-rank-under-python": (
        "python",
        ("batch.global_batch_size=8", "batch.grad_accum_steps=2", "distributed.strategy=deepspeed"),
        "deepspeed --num_gpus 2",
    ),
    "unknown-strategy": ("python", ("distributed.strategy=megatron",), "distributed.strategy"),
    "unknown-preset": ("python", ("distributed.strategy=deepspeed", "distributed.preset=zero9"), "zero9"),
    "missing-data": ("python", ("data.path=/nonexistent/train.jsonl",), "/nonexistent/train.jsonl"),
    "empty-data": ("python", ("data.path={root}/empty.jsonl",), "no examples"),
    "malformed-data": ("python", ("data.path={root}/malformed.jsonl",), "malformed.jsonl:3"),
    "truncated-away": ("python", ("data.path={root}/long.jsonl", "data.max_seq_len=16"), "data.max_seq_len"),
    "output-dir-is-a-file": ("python", ("output_dir={root}/a-file",), "is a file, not a folder"),
    "nothing-to-resume": (
        "python",
        ("run_name=never-ran", "checkpoint.resume=true"),
        "never-ran does not exist",
    ),
}
BEFORE_MODEL = {
    "indivisible",
    "indivisible-2-ranks",
    "multi-rank-under-python",
    "unknown-strategy",
    "unknown-preset",
    "output-dir-is-a-file",
    "nothing-to-resume",
}
# Fails on the data, after the tokenizer (which builds the tiny model into the cache) has loaded.
REACHES_TOKENIZER = "malformed-data"


@pytest.fixture(scope="module")
def bad_runs(setup: dict[str, Path]) -> tuple[dict[str, RunResult], dict[str, tuple[int, int]], list[str]]:
    earlier = setup["out"] / RUN
    before = _snapshot(earlier)
    launches = []
    for name, (launcher, overrides, _) in BAD.items():
        filled = tuple(o.format(root=setup["root"]) for o in overrides)
        # Batch and engine errors get an empty model cache: it must stay empty (no model was loaded).
        own_cache = name in BEFORE_MODEL or name == REACHES_TOKENIZER
        env = {"ZEROFIT_CACHE": str(setup["root"] / f"cache-{name}")} if own_cache else {}
        # run_name=earlier for all: a user error must not touch (or suffix next to) the earlier run.
        launches.append(Launch(RUN, launcher, filled, key=name, env=env))
    results = run_launches(launches, setup["config"], setup["out"])
    return results, before, sorted(p.name for p in setup["out"].iterdir())


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_fails_clearly(bad_runs: tuple[dict[str, RunResult], object, object], name: str) -> None:
    run = bad_runs[0][name]
    message = BAD[name][2]
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert "error:" in run.stderr


@pytest.mark.parametrize("name", sorted(BEFORE_MODEL))
def test_batch_and_engine_errors_come_before_any_model_load(
    bad_runs: tuple[dict[str, RunResult], object, object], setup: dict[str, Path], name: str
) -> None:
    cache = setup["root"] / f"cache-{name}"
    assert not cache.exists() or not any(cache.iterdir())
    control = setup["root"] / f"cache-{REACHES_TOKENIZER}"
    assert bad_runs[0][REACHES_TOKENIZER].returncode == 2
    assert any(control.glob("tiny-llama-seed*/tokenizer.json")), "the cache override was not honoured"


def test_nothing_written_to_the_earlier_run(
    bad_runs: tuple[dict[str, RunResult], dict[str, tuple[int, int]], list[str]], setup: dict[str, Path]
) -> None:
    _, before, listing = bad_runs
    assert _snapshot(setup["out"] / RUN) == before
    assert listing == ["_logs", RUN]  # no `earlier-2` either


def test_a_new_run_with_a_taken_name_gets_its_own_directory(bad_runs: object, setup: dict[str, Path]) -> None:
    earlier = setup["out"] / RUN
    before = _snapshot(earlier)
    run = run_one(Launch(RUN, "python"), setup["config"], setup["out"]).check()
    assert f"run dir      {earlier}-2" in run.stdout
    assert (setup["out"] / f"{RUN}-2" / "metrics.jsonl").is_file()
    assert _snapshot(earlier) == before
