"""On-policy distillation (`train.objective: gkd`): the config's rules, the on-policy coin, and runs in this
process on the tiny model: a zerofit run folder as the teacher (lmbda 0: the data's completions; lmbda 1: the
student's samples, no completion column; seq_kd: the teacher's samples), a teacher of another vocabulary and a record without a completion
each refused in one paragraph with exit code 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from config_helpers import REPO
from zerofit.config import load_config
from zerofit.core.errors import ConfigError
from zerofit.loop.distill import on_policy
from zerofit.resolution import resolve

GKD = [
    "distributed.strategy=single",
    "distributed.preset=null",
    "train.objective=gkd",
    "batch.global_batch_size=null",
    "batch.micro_batch_size=2",
    "rl.num_generations=2",
    "rl.prompts_per_step=2",
    "data.eval_split=null",
    "data.eval_path=null",
]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # configs/demo.yaml and data/ as a user's shell names them


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(load_config(REPO / "configs" / "demo.yaml", [*GKD, *overrides]), 1)
    return str(err.value)


def test_the_rules_refuse_in_one_paragraph_each() -> None:
    assert "gkd.teacher is unset" in _problems()
    teacher = "gkd.teacher=tiny-llama"
    said = _problems(teacher, "rl.num_iterations=2", "rl.beta=0.1", "train.cross_entropy=fused_linear")
    assert "rl.num_iterations = 2" in said and "rl.beta = 0.1" in said
    assert "train.cross_entropy = 'fused_linear'" in said
    assert "rl.rewards is set" in _problems(teacher, "rl.rewards=[{function: exact_match, column: a}]")
    assert "batch.global_batch_size = 3" in _problems(teacher, "batch.global_batch_size=3")
    assert "data.format = 'preference'" in _problems(teacher, "data.format=preference")


def test_the_resolved_plan_says_the_divergence_and_the_teacher() -> None:
    resolved = resolve(load_config(REPO / "configs" / "demo.yaml", [*GKD, "gkd.teacher=tiny-llama"]), 1)
    cfg = resolved.config
    assert cfg.batch.global_batch_size == 4 and cfg.train.cross_entropy == "chunked"
    line = resolved.objective.describe(cfg, "none")
    assert line is not None and "generalized JSD (beta 0.5) to teacher tiny-llama" in line
    assert resolved.objective.teacher_model(cfg) == "tiny-llama"


def test_the_on_policy_coin_is_seeded_per_completion_and_its_fraction_is_lmbda() -> None:
    draws = [on_policy(3, step, c, 0.3) for step in range(50) for c in range(40)]
    assert draws == [on_policy(3, step, c, 0.3) for step in range(50) for c in range(40)]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.03
    assert not any(on_policy(3, 0, c, 0.0) for c in range(100))
    assert all(on_policy(3, 0, c, 1.0) for c in range(100))
    assert draws != [on_policy(4, step, c, 0.3) for step in range(50) for c in range(40)]  # the seed's


def _launch(*args: str) -> int:
    from zerofit.recipe import run

    return run.main(["--config", "configs/demo.yaml", *args])


def _common(tmp_path: Path, name: str) -> list[str]:
    return [
        f"output_dir={tmp_path}",
        f"run_name={name}",
        "train.max_steps=2",
        "train.precision=fp32",
        "checkpoint.every_steps=0",
        "logging.console=false",
        "logging.wandb.mode=disabled",
        "distributed.strategy=single",
        "distributed.preset=null",
    ]


def _gkd(tmp_path: Path, name: str, teacher: str, data: Path, *more: str) -> list[str]:
    return [
        *_common(tmp_path, name),
        *GKD,
        f"gkd.teacher={teacher}",
        f"data.path={data}",
        "rl.max_completion_length=6",
        "rl.log_completions_every=1",
        *more,
    ]


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


@pytest.mark.slow
def test_a_run_folder_teaches_on_the_datas_and_on_the_students_completions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = ("batch.micro_batch_size=4", "optimizer.lr=0.05", "scheduler.warmup_steps=0")  # moves far
    assert _launch(*_common(tmp_path, "teacher"), *teacher) == 0  # an SFT run of the demo: LoRA adapters
    data = tmp_path / "distill.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"add: {i}+{i}\n", "completion": str(2 * i)}) + "\n" for i in range(8))
    )
    assert _launch(*_gkd(tmp_path, "offline", str(tmp_path / "teacher"), data, "gkd.lmbda=0")) == 0
    offline = _rows(tmp_path / "offline")
    assert [r["on_policy_fraction"] for r in offline] == [0.0, 0.0] and offline[0]["loss"] > 1e-4
    shown = _rows(tmp_path / "offline", "completions.jsonl")
    assert {r["completion"] for r in shown} <= {str(2 * i) for i in range(8)}
    assert not any(r["on_policy"] for r in shown)
    no_labels = tmp_path / "prompts.jsonl"  # the student's samples only: no completion column needed
    no_labels.write_text("".join(json.dumps({"prompt": f"add: {i}+1\n"}) + "\n" for i in range(8)))
    assert _launch(*_gkd(tmp_path, "online", str(tmp_path / "teacher"), no_labels, "gkd.lmbda=1")) == 0
    online = _rows(tmp_path / "online")
    assert [r["on_policy_fraction"] for r in online] == [1.0, 1.0] and online[0]["loss"] > 1e-4
    assert all(r["on_policy"] for r in _rows(tmp_path / "online", "completions.jsonl"))
    seq_kd = _launch(
        *_gkd(tmp_path, "seq_kd", str(tmp_path / "teacher"), no_labels, "gkd.lmbda=0", "gkd.seq_kd=true")
    )
    assert seq_kd == 0  # the off-policy completions are the teacher's samples: no completion column either
    taught = _rows(tmp_path / "seq_kd")
    assert [r["on_policy_fraction"] for r in taught] == [0.0, 0.0] and taught[0]["loss"] > 1e-4
    refused = _launch(*_gkd(tmp_path, "unlabelled", str(tmp_path / "teacher"), no_labels, "gkd.lmbda=0.5"))
    err = capsys.readouterr().err
    assert refused == 2 and "record 1 has no 'completion' text" in err and "gkd.lmbda=1" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_teacher_of_another_vocabulary_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = REPO / "data" / "demo.jsonl"
    code = _launch(*_gkd(tmp_path, "mismatch", "tiny-qwen3", data, "gkd.lmbda=1", "data.format=auto"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    said = " ".join(err.split())
    assert "gkd.teacher = 'tiny-qwen3' has another vocabulary than the student" in said
    assert "model.name_or_path 'tiny-llama'" in said and "101 tokens" in said and "103 tokens" in said


@pytest.mark.slow
def test_a_quantized_teacher_on_the_cpu_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = REPO / "data" / "demo.jsonl"
    args = _gkd(tmp_path, "quantized", "tiny-llama", data, "gkd.lmbda=1", "gkd.teacher_load_in=8bit")
    code = _launch(*args)
    said = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "Traceback" not in said
    assert "gkd.teacher_load_in = '8bit' quantizes the teacher with bitsandbytes on CUDA" in said
