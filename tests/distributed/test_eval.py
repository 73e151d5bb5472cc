"""Evaluation through the real launchers: one global batch split three ways gives the same evaluation loss.

Multi-turn chat data (assistant-only labels) with 20% of its conversations held out (`data.eval_split`),
evaluated every 2 steps and after the last of 3, in fp32, as

    launch   launcher   engine             split                        data
    single   api        one process        micro 4 x accum 2 x dp 1     a Parquet file (`zerofit.train`)
    zero3    torchrun   DeepSpeed ZeRO-3   micro 2 x accum 2 x dp 2     a `save_to_disk` folder, W&B offline
    fsdp     torchrun   FSDP2              micro 1 x accum 4 x dp 2     the JSONL file

The 9 eval conversations do not fill the last window of any split, so ranks without an example run a
masked dummy row. Evaluation losses and token counts agree across the splits within 1e-5 and equal a
reference computed here, one conversation at a time, from the exported adapter; W&B holds the same numbers
on the step axis; `zerofit compare` shows them. The same launches run `eval.harness` (lm-eval's shipped sums
task, 3 documents) at the same steps: rank 0 scores the weights gathered from every rank (ZeRO-3's
partitions, FSDP2's shards), and every engine's replies equal the one-process run's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from launch_helpers import Launch, RunResult, run_launches, write_config
from zerofit.data import hold_out, load_examples
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.token_loss.sums import IGNORE_INDEX

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

N_CHATS, GLOBAL, STEPS, SEED, MAX_LEN, EVAL_SPLIT = 45, 8, 3, 11, 96, 0.2
TOL = 1e-5
HARNESS_TASK = "zerofit_demo_sums"
LAUNCHES = [
    Launch(
        "single", "api", ("distributed.strategy=single", "batch.micro_batch_size=4", "data.path={parquet}")
    ),
    Launch(
        "zero3",
        "torchrun",  # DeepSpeed ZeRO-3 (the config's strategy) under torchrun
        (
            "distributed.preset=zero3",
            "batch.micro_batch_size=2",
            "data.path={saved}",
            "logging.wandb.mode=offline",
        ),
    ),
    Launch(
        "fsdp", "torchrun", ("distributed.strategy=fsdp", "batch.micro_batch_size=1", "data.path={jsonl}")
    ),
]


def _conversation(i: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": "be exact"}] if i % 4 == 0 else []
    for turn in range(1 + i % 3):
        a, b = (7 * i + turn) % 50, (3 * i + 5 * turn) % 50
        messages += [
            {"role": "user", "content": f"add: {a}+{b}"},
            {"role": "assistant", "content": str(a + b)},
        ]
    return {"messages": messages}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import datasets

    root = tmp_path_factory.mktemp("eval-data")
    chats = [_conversation(i) for i in range(N_CHATS)]
    jsonl = root / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in chats))
    datasets.Dataset.from_list(chats).to_parquet(str(root / "chats.parquet"))
    datasets.Dataset.from_list(chats).save_to_disk(str(root / "chats-saved"))
    return {"jsonl": jsonl, "parquet": root / "chats.parquet", "saved": root / "chats-saved"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data: dict[str, Path]) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("eval")
    config = write_config(
        root / "eval.yaml",
        {
            "seed": SEED,
            "batch": {"global_batch_size": GLOBAL},
            "distributed": {"strategy": "deepspeed"},
            "train": {"max_steps": STEPS, "precision": "fp32"},
            "optimizer": {"lr": 1e-2},
            "lora": {"dropout": 0.0},
            "data": {"max_seq_len": MAX_LEN, "eval_split": EVAL_SPLIT, "cache": False},
            "eval": {
                "every_steps": 2,
                "harness": {"tasks": [HARNESS_TASK], "every_steps": 2, "limit": 3},
            },
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    launches = [
        Launch(
            lau.name,
            lau.launcher,
            tuple(o.format(**{k: str(v) for k, v in data.items()}) for o in lau.overrides),
        )
        for lau in LAUNCHES
    ]
    results = run_launches(launches, config, root / "runs")
    for result in results.values():
        result.check()
    return results


def _evaluated(run: RunResult) -> dict[int, dict[str, Any]]:
    return {row["step"]: row for row in run.metrics if "eval/loss" in row}


def test_evaluations_happen_every_2_steps_and_at_the_end(runs: dict[str, RunResult]) -> None:
    for name, run in runs.items():
        assert sorted(_evaluated(run)) == [2, 3], name
        assert [row["step"] for row in run.metrics] == [1, 2, 3]
    assert "eval         9 examples (0.2 of " in runs["single"].stdout  # the plan says what is evaluated
    assert "[messages, detected]" in runs["zero3"].stdout


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_eval_loss_is_the_same_whatever_the_split(runs: dict[str, RunResult], name: str) -> None:
    ref, run = _evaluated(runs["single"]), _evaluated(runs[name])
    for step in (2, 3):
        assert run[step]["eval/tokens"] == ref[step]["eval/tokens"] > 0
        assert abs(run[step]["eval/loss"] - ref[step]["eval/loss"]) < TOL, (step, run[step], ref[step])
    # Same training too (Parquet, save_to_disk and JSONL gave the same examples, split the same way).
    assert runs[name].series("tokens") == runs["single"].series("tokens")
    assert (
        max(abs(a - b) for a, b in zip(runs[name].series("loss"), runs["single"].series("loss"), strict=True))
        < TOL
    )
    assert ref[2]["eval/loss"] != ref[3]["eval/loss"]  # the model moved between the evaluations


@pytest.mark.parametrize("name", ["single", "zero3", "fsdp"])
def test_the_harness_scores_the_gathered_weights_on_every_engine(
    runs: dict[str, RunResult], name: str
) -> None:
    """`eval.harness` after steps 2 and 3: the score in the step's row (beside eval/loss), the results file
    with the replies, and the replies of the weights rank 0 gathered equal to the one-process run's."""
    from zerofit.core.run_layout import RunLayout
    from zerofit.metrics.keys import harness_field

    key = harness_field(HARNESS_TASK, "acc")
    rows = {row["step"]: row for row in runs[name].metrics if key in row}
    assert sorted(rows) == [2, 3] and all("eval/loss" in row for row in rows.values())
    for step in (2, 3):
        report = json.loads(RunLayout(runs[name].run_dir).harness(step).read_text())
        reference = json.loads(RunLayout(runs["single"].run_dir).harness(step).read_text())
        assert report["step"] == step and report["scores"]["trained"][HARNESS_TASK]["acc"] == rows[step][key]
        assert len(report["replies"]["trained"][HARNESS_TASK]) == 3
        assert report["replies"] == reference["replies"], (name, step)


def test_eval_loss_is_the_token_mean_over_the_eval_set(
    runs: dict[str, RunResult], data: dict[str, Path]
) -> None:
    """A reference from the exported adapter: each eval conversation alone, token sums over the whole set."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = ensure_tiny_llama(SEED)
    tokenized = load_examples(data["jsonl"], AutoTokenizer.from_pretrained(base), MAX_LEN)
    held = hold_out(tokenized, EVAL_SPLIT, SEED)[1].examples
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), runs["single"].run_dir / "adapter"
    ).eval()
    sums, counts = [], []
    with torch.no_grad():
        for example in held:
            logits = model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1]
            labels = torch.tensor(example.labels[1:])
            losses = torch.nn.functional.cross_entropy(
                logits, labels, ignore_index=IGNORE_INDEX, reduction="none"
            )
            sums.append(float(losses.sum()))
            counts.append(int((labels != IGNORE_INDEX).sum()))
    token_mean = sum(sums) / sum(counts)
    final = _evaluated(runs["single"])[3]
    assert final["eval/tokens"] == sum(counts)
    assert abs(final["eval/loss"] - token_mean) < TOL, (final["eval/loss"], token_mean)
    mean_of_means = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
    assert abs(mean_of_means - token_mean) > 10 * TOL  # the normalization is observable on this data


def test_wandb_has_the_evaluations_on_the_step_axis(runs: dict[str, RunResult]) -> None:
    from zerofit.metrics.wandb_reader import read_wandb_run

    (run_file,) = (runs["zero3"].run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged = read_wandb_run(run_file)
    for step, row in _evaluated(runs["zero3"]).items():
        assert logged.history[step]["train/step"] == step
        assert logged.history[step]["eval/loss"] == row["eval/loss"]
        assert logged.history[step]["eval/tokens"] == row["eval/tokens"]
    assert "eval/loss" not in logged.history[1]
    assert logged.summary["summary/eval_loss"] == _evaluated(runs["zero3"])[3]["eval/loss"]


def test_compare_shows_the_eval_loss(
    runs: dict[str, RunResult], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerofit.cli import main

    names = [launch.name for launch in LAUNCHES]
    assert main(["compare", *(str(runs[n].run_dir) for n in names), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "final eval loss" in line]
    final = [_evaluated(runs[n])[3]["eval/loss"] for n in names]
    assert [f"{v:.4f}" for v in final] == [cell for cell in line.split() if cell.replace(".", "").isdigit()]
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["plots"][str(tmp_path / "eval_loss_vs_step.png")] == names
    assert all(math.isclose(s["eval_loss"], v) for s, v in zip(report["summaries"], final, strict=True))
