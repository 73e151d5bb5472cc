"""Built-in families on 2 gloo ranks through the real launchers (issue 18): DeepSpeed ZeRO-2 and FSDP2, LoRA
all-linear (the MoE models with every routed expert and the router), 2 steps each, the adapter exported.

Every held-out-style family of the issue (Qwen3, Gemma-3, Phi-3, Mixtral, Qwen3-MoE) and the MoE recipe's
tiny twin (Qwen2-MoE, the class of configs/qwen15-moe-qlora-2x3090-fsdp.yaml) runs on 2 ranks once, on one
of the two engines, each engine with LoRA and QLoRA (4-bit base) runs: one launch each (launches cannot be
shared: DeepSpeed's CPU shared-memory comm cannot be initialized twice in one process, and a second FSDP2
run in one torchrun launch was seen to hang at its process-group set-up). Not every family on every engine:
the suite's time budget. Every family also trains on one process in tests/unit/test_families.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch_helpers import REPO, Launch, RunResult, run_launches, write_config
from zerofit.cli import main as cli
from zerofit.config import load_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MOE = {"tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe"}
# run name -> (launcher, family, its decoder-layer class, quantized): each family once, both engines, LoRA
# and QLoRA (4-bit base) on each engine.
RUNS = {
    "zero2-tiny-qwen3": ("deepspeed", "tiny-qwen3", "Qwen3DecoderLayer", True),
    "zero2-tiny-phi3": ("deepspeed", "tiny-phi3", "Phi3DecoderLayer", False),
    "zero2-tiny-qwen3-moe": ("deepspeed", "tiny-qwen3-moe", "Qwen3MoeDecoderLayer", True),
    "fsdp-tiny-gemma3": ("torchrun", "tiny-gemma3", "Gemma3DecoderLayer", False),
    "fsdp-tiny-mixtral": ("torchrun", "tiny-mixtral", "MixtralDecoderLayer", True),
    "fsdp-tiny-qwen2-moe": ("torchrun", "tiny-qwen2-moe", "Qwen2MoeDecoderLayer", False),
}


def _launch(run_name: str) -> Launch:
    launcher, name, _, quantized = RUNS[run_name]
    engine = (
        ["distributed.strategy=deepspeed", "distributed.preset=zero2"]
        if launcher == "deepspeed"
        else ["distributed.strategy=fsdp", "distributed.preset=fsdp"]
    )
    moe = ["lora.moe_experts=all", "lora.train_router=true"] if name in MOE else []
    qlora = ["quantization.load_in=4bit", "train.precision=bf16"] if quantized else []
    return Launch(run_name, launcher, (f"model.name_or_path={name}", *engine, *moe, *qlora))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    out = tmp_path_factory.mktemp("families")
    config = write_config(
        out / "config.yaml",
        {
            "seed": 0,
            "batch": {"global_batch_size": 4, "micro_batch_size": 1},
            "train": {"max_steps": 2, "precision": "fp32"},
            "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"},
            "data": {"path": str(REPO / "data" / "demo_chat.jsonl"), "max_seq_len": 64},
            "logging": {"wandb": {"mode": "disabled"}},
        },
    )
    return run_launches([_launch(name) for name in RUNS], config, out / "runs", max_parallel=3)


@pytest.mark.parametrize("run_name", list(RUNS))
def test_family_trains_on_two_ranks(runs: dict[str, RunResult], run_name: str) -> None:
    """Two finite steps, the adapter exported, the plan's lora line (and 4-bit base for QLoRA); FSDP2
    shards the model's own layer."""
    result = runs[run_name].check()
    losses = [row["loss"] for row in result.metrics if "loss" in row]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert (result.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert "  lora         " in result.stdout and "all-linear" in result.stdout
    if RUNS[run_name][3]:
        assert load_config(result.run_dir / "config.yaml").quantization.load_in == "4bit"
    if RUNS[run_name][0] == "torchrun":
        wrap = json.loads((result.run_dir / "fsdp.json").read_text())["wrap"]
        assert wrap["layer_class"] == RUNS[run_name][2]


def test_an_fsdp_trained_moe_exports_merged(runs: dict[str, RunResult], tmp_path: Path) -> None:
    merged = tmp_path / "merged"
    assert (
        cli(["export", str(runs["fsdp-tiny-mixtral"].check().run_dir), "--merge", "--out", str(merged)]) == 0
    )
    assert (merged / "model.safetensors").is_file()
