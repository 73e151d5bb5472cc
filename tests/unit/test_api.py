"""The Python API in this process, as a notebook uses it: `import zerofit` stays light; `zerofit.plan` is
`zerofit plan --json`; `zerofit.train` trains 3 steps on each data format (multi-turn chat from Parquet, text
from a `save_to_disk` folder, alpaca from CSV, prompt/response from JSONL) and every step trains on exactly the
label tokens the data pipeline masked in (chat: the assistant turns only)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import zerofit
from config_helpers import DEMO_DATA
from zerofit.api import _override_items
from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import RunLayout
from zerofit.data import GlobalBatchSampler, load_examples
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.token_loss.sums import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
GLOBAL, STEPS, SEED, MAX_LEN = 4, 3, 5, 256  # the Alpaca prompt alone is ~190 tokens
BASE: dict[str, Any] = {
    "seed": SEED,
    "batch": {"global_batch_size": GLOBAL, "micro_batch_size": 2},
    "distributed": {"strategy": "single"},
    "train": {"max_steps": STEPS, "precision": "fp32"},
    "lora": {"dropout": 0.0},
    "data": {"max_seq_len": MAX_LEN},
    "logging": {"console": False, "wandb": {"mode": "disabled"}},
}


def _chat(i: int) -> dict[str, Any]:
    turns = [("user", f"add: {i}+{i}"), ("assistant", str(2 * i)), ("user", f"copy: {'ab' * (i % 4 + 1)}")]
    messages = [{"role": role, "content": text} for role, text in turns]
    messages.append({"role": "assistant", "content": "ab" * (i % 4 + 1)})
    return {"messages": ([{"role": "system", "content": "be exact"}] if i % 3 == 0 else []) + messages}


def _write_data(root: Path) -> dict[str, Path]:
    import datasets

    chats = [_chat(i) for i in range(16)]
    datasets.Dataset.from_list(chats).to_parquet(str(root / "chat.parquet"))
    texts = [{"text": f"{i} " + "the quick brown fox jumps " * (1 + i % 12)} for i in range(14)]
    datasets.Dataset.from_list(texts).save_to_disk(str(root / "text-saved"))
    with (root / "alpaca.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, ["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows(
            {"instruction": "upper", "input": "ab" * i, "output": "AB" * i} for i in range(1, 13)
        )
    lines = [json.dumps({"prompt": f"reverse: {'xyz' * i}\n", "response": "zyx" * i}) for i in range(1, 13)]
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return {
        "messages": root / "chat.parquet",
        "text": root / "text-saved",
        "alpaca": root / "alpaca.csv",
        "prompt_response": root / "pairs.jsonl",
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `zerofit.train` per format, the chat one with a held-out eval split evaluated every 2 steps."""
    root = tmp_path_factory.mktemp("api")
    paths = _write_data(root)
    from zerofit.strategies.env import RENDEZVOUS_VARIABLES

    # As in a notebook, no launch around the calls (another in-process test in this worker may have left one).
    outer = {key: os.environ.pop(key) for key in RENDEZVOUS_VARIABLES if key in os.environ}
    env_before = dict(os.environ)
    results = {
        fmt: zerofit.train(
            BASE,
            output_dir=str(root / "runs"),
            run_name=fmt,
            **{"data.path": str(path)},
            **({"data.eval_split": 0.25, "eval__every_steps": 2} if fmt == "messages" else {}),
        )
        for fmt, path in paths.items()
    }
    env_after = dict(os.environ)
    os.environ.update(outer)
    return {"results": results, "paths": paths, "env_before": env_before, "env_after": env_after}


def test_train_leaves_no_launch_behind(runs: dict[str, Any]) -> None:
    # It used to leave RANK/WORLD_SIZE/MASTER_PORT set: accelerate (TRL's trainers) next in the process saw
    # a distributed launch, and each later call ran as one started by a launcher.
    import torch.distributed as dist

    from zerofit.strategies.env import RENDEZVOUS_VARIABLES as launch

    assert {key: runs["env_after"].get(key) for key in launch} == {key: None for key in launch}
    assert not (dist.is_available() and dist.is_initialized())


def test_import_zerofit_is_light() -> None:
    code = (
        "import sys, zerofit; print(callable(zerofit.train), callable(zerofit.plan), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "False"]
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        _ = zerofit.trian  # type: ignore[attr-defined]


def test_the_documented_batch_api_imports_from_its_old_path_too() -> None:
    """docs/contracts.md's batch API from before the packages by role: the same module and class, no torch."""
    code = (
        "import sys\n"
        "from zerofit.batching import BatchConfigError, BatchPlan, solve_batch\n"
        "import zerofit.config.batching as moved\n"
        "split = solve_batch(2, global_batch_size=16, micro_batch_size=4)\n"
        "print(sys.modules['zerofit.batching'] is moved, BatchPlan is moved.BatchSplit,"
        " solve_batch is moved.solve_batch, split.grad_accum_steps, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True", "2", "False"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["messages", "text", "alpaca", "prompt_response"])
def test_train_runs_each_format_and_returns_its_result(runs: dict[str, Any], fmt: str) -> None:
    result = runs["results"][fmt]
    assert result.run_dir.name == fmt and result.steps == STEPS
    assert [row["step"] for row in result.metrics] == [1, 2, 3]
    assert result.final_loss == result.metrics[-1]["loss"] and 0 < result.final_loss < 10
    assert result.config["data"]["format"] == fmt  # `auto`, resolved to what the data is
    assert (result.export_dir / "adapter_model.safetensors").is_file()
    assert (result.export_dir / "chat_template.jinja").is_file()  # generation can render chat later


@pytest.mark.slow
def test_the_run_directory_holds_what_its_layout_names(runs: dict[str, Any]) -> None:
    """What a run writes is what `RunLayout` (docs/contracts.md's run directory) names, and nothing else."""
    result = runs["results"]["prompt_response"]
    layout = RunLayout(result.run_dir)
    expected = {
        layout.config,
        layout.engine_file("single"),
        layout.metrics,
        layout.run_info,
        layout.summary,
        layout.checkpoints,
        layout.lock,
        layout.adapter,
    }
    assert set(result.run_dir.iterdir()) == expected
    assert result.export_dir == layout.export(adapter=True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["messages", "text", "alpaca", "prompt_response"])
def test_every_step_trains_on_exactly_the_masked_in_tokens(runs: dict[str, Any], fmt: str) -> None:
    """The label tokens of each step's global batch, from the data pipeline and the sampler, are the ones
    the run trained on: for chat, the assistant turns' tokens only (about a third of the tokens here)."""
    from transformers import AutoTokenizer

    result = runs["results"][fmt]
    data = load_examples(runs["paths"][fmt], AutoTokenizer.from_pretrained(ensure_tiny_llama(SEED)), MAX_LEN)
    if fmt == "messages":
        from zerofit.data import hold_out

        data = hold_out(data, 0.25, SEED)[0]
    sampler = GlobalBatchSampler(len(data.examples), GLOBAL, SEED)
    for step, row in enumerate(result.metrics):
        batch = [data.examples[i] for i in sampler.batch_indices(step)]
        assert row["tokens"] == sum(sum(label != IGNORE_INDEX for label in e.labels[1:]) for e in batch)
        if fmt == "messages":
            every = sum(len(e.input_ids) - 1 for e in batch)
            assert row["tokens"] < every / 2  # the prompt side, roles and system turns are not learned


@pytest.mark.slow
def test_train_returns_the_evaluation(runs: dict[str, Any]) -> None:
    result = runs["results"]["messages"]
    evaluated = {row["step"]: row for row in result.metrics if "eval/loss" in row}
    assert sorted(evaluated) == [2, 3]  # every 2 steps, and after the last
    assert result.eval_loss == evaluated[3]["eval/loss"] and result.summary["eval_loss"] == result.eval_loss
    assert evaluated[2]["eval/tokens"] == evaluated[3]["eval/tokens"] > 0
    assert all(runs["results"][fmt].eval_loss is None for fmt in ("text", "alpaca", "prompt_response"))


def test_plan_is_what_the_command_line_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from zerofit.cli import main

    config = str(REPO / "configs" / "demo.yaml")
    report = zerofit.plan(config, world_size=2, gpu="rtx3090", batch__micro_batch_size=2)
    assert report["batch"]["formula"] == "global 16 = micro 2 x accum 4 x dp 2"
    capsys.readouterr()
    args = [
        "plan",
        "--config",
        config,
        "--world-size",
        "2",
        "--gpu",
        "rtx3090",
        "--json",
        "batch.micro_batch_size=2",
    ]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == report


def test_overrides_in_every_spelling_mean_the_same() -> None:
    spelled = [
        {"train.max_steps": 7, "data.shuffle": False},
        {"train__max_steps": 7, "data__shuffle": False},
        {"train": {"max_steps": 7}, "data": {"shuffle": False}},
    ]
    assert all(_override_items(s) == {"train": {"max_steps": 7}, "data": {"shuffle": False}} for s in spelled)


def test_user_errors_raise_the_paragraph(tmp_path: Path) -> None:
    base = {**BASE, "data": {"path": DEMO_DATA}}
    with pytest.raises(ConfigError, match=r"Valid micro_batch_size values"):
        zerofit.train(base, batch={"global_batch_size": 3}, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"unknown key 'train\.max_stpes'; did you mean 'train\.max_steps'"):
        zerofit.plan(base, train__max_stpes=3)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_eval_data_with_0_tokens_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eval examples whose labels are all masked (as a tampered cache entry once served) stop the run when
    the data is loaded, with the paragraph, before a model or a checkpoint exists."""
    from zerofit.core.errors import DataError
    from zerofit.data import Example
    from zerofit.recipe import assembly

    real = assembly.load_examples

    def masked_eval(*args: Any, **kwargs: Any) -> Any:
        data = real(*args, **kwargs)
        if kwargs["key"] == "data.eval_path":
            data.examples = [Example(e.input_ids, [IGNORE_INDEX] * len(e.labels)) for e in data.examples]
        return data

    monkeypatch.setattr(assembly, "load_examples", masked_eval)
    monkeypatch.setattr(assembly, "build_model", lambda *a, **k: pytest.fail("the model was loaded"))
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(12)))
    saved_env = dict(os.environ)
    try:
        with pytest.raises(DataError, match=r"the evaluation data .* holds 12 examples whose labels are all"):
            zerofit.train(
                BASE, output_dir=str(tmp_path / "runs"), data__path=str(path), data__eval_path=str(path)
            )
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert not list((tmp_path / "runs").rglob("step-*"))


def test_a_keyword_strategy_over_a_files_preset_switches_engine_as_the_command_line_does() -> None:
    """`distributed__strategy="single"` over configs/demo.yaml (a ZeRO-2 preset) drops the preset, as
    `distributed.strategy=single` on the command line does (it contradicted the preset), in every spelling
    and with a GPU named (which re-validates the config)."""
    from zerofit.config import load_config
    from zerofit.planner import choose_fastest_plan
    from zerofit.resolution import resolve

    config = REPO / "configs" / "demo.yaml"
    cli = resolve(load_config(config, ["distributed.strategy=single"]), 1, choose_fastest_plan).config
    assert (cli.distributed.strategy, cli.distributed.preset) == ("single", None)
    for spelled in ({"distributed__strategy": "single"}, {"distributed": {"strategy": "single"}}):
        for gpu in (None, "rtx3090"):
            report = zerofit.plan(config, gpu=gpu, **spelled)
            assert (report["strategy"], report["preset"]) == ("single", None), spelled
