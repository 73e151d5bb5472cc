"""Built-in families on 2 gloo ranks through the real launchers (issue 18): DeepSpeed ZeRO-2 and FSDP2, LoRA
all-linear (the MoE models with every routed expert and the router), 2 steps each, the adapter exported.

A representative subset, one launch per family (launches cannot be shared: DeepSpeed's CPU shared-memory
comm cannot be initialized twice in one process, and a second FSDP2 run in one torchrun launch was seen to
hang at its process-group set-up): ZeRO-2 runs Phi-3 (fused projections) and Qwen3-MoE (routed experts);
FSDP2 runs Gemma-3 (sliding window, q/k norms, tied embeddings) and Mixtral (experts only). Every family trains on one process in tests/unit/test_families.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch_helpers import REPO, Launch, RunResult, run_launches, write_config
from zerofit.cli import main as cli

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MOE = {"tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe"}
RUNS = {
    "zero2-tiny-phi3": ("deepspeed", "tiny-phi3", "Phi3DecoderLayer"),
    "zero2-tiny-qwen3-moe": ("deepspeed", "tiny-qwen3-moe", "Qwen3MoeDecoderLayer"),
    "fsdp-tiny-gemma3": ("torchrun", "tiny-gemma3", "Gemma3DecoderLayer"),
    "fsdp-tiny-mixtral": ("torchrun", "tiny-mixtral", "MixtralDecoderLayer"),
}


def _launch(run_name: str) -> Launch:
    launcher, name, _ = RUNS[run_name]
    engine = (
        ["distributed.strategy=deepspeed", "distributed.preset=zero2"]
        if launcher == "deepspeed"
        else ["distributed.strategy=fsdp", "distributed.preset=fsdp"]
    )
    moe = ["lora.moe_experts=all", "lora.train_router=true"] if name in MOE else []
    return Launch(run_name, launcher, (f"model.name_or_path={name}", *engine, *moe))


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
    """Two finite steps, the adapter exported, the plan's lora line; FSDP2 shards the model's own layer."""
    result = runs[run_name].check()
    losses = [row["loss"] for row in result.metrics if "loss" in row]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert (result.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert "  lora         " in result.stdout and "all-linear" in result.stdout
    if RUNS[run_name][0] == "torchrun":
        wrap = json.loads((result.run_dir / "fsdp.json").read_text())["wrap"]
        assert wrap["layer_class"] == RUNS[run_name][2]


def test_an_fsdp_trained_moe_exports_merged(runs: dict[str, RunResult], tmp_path: Path) -> None:
    merged = tmp_path / "merged"
    assert (
        cli(["export", str(runs["fsdp-tiny-mixtral"].check().run_dir), "--merge", "--out", str(merged)]) == 0
    )
    assert (merged / "model.safetensors").is_file()
