"""The memory techniques train through the real launchers, on every engine that takes a client optimizer.

Real launches (deepspeed, torchrun; 2 gloo ranks) and one-process runs of the Python API (`zerofit.train`, in
the test process), LoRA r=64 on a small data set seen every step, so the loss must fall:

- single: QLoRA (4-bit base) + paged_adamw_8bit + activation checkpointing;
- single: LoRA on an 8-bit base + lion_8bit;
- DeepSpeed ZeRO-2 (under torchrun): LoRA + adamw_8bit as the client optimizer + activation checkpointing;
- FSDP2: LoRA + adamw_8bit (bitsandbytes steps each rank's DTensor shard, see zerofit/optim_dtensor.py),
  and a resume from the step-3 checkpoint that continues exactly (the 8-bit state of both ranks is restored).

For each: exit 0, the loss falls; the checkpoint's optimizer state is 8-bit (uint8 codes) wherever
bitsandbytes quantizes (tensors of >= 4096 elements; smaller ones keep fp32 state by bitsandbytes' design);
the checkpoint holds exactly the adapter weights (frozen base excluded) and the export is the adapter only,
with every adapter trained (LoRA B starts at zero).

    launch                 launcher   engine             what
    lora-adamw8-zero2      torchrun   DeepSpeed ZeRO-2   LoRA, adamw_8bit client optimizer, checkpointing
    lora-adamw8-fsdp       torchrun   FSDP2              LoRA, adamw_8bit on DTensor shards
    qlora-paged-single     api        one process        QLoRA, paged_adamw_8bit, checkpointing
    lora8bit-lion-single   api        one process        LoRA on an 8-bit base, lion_8bit
    lora-adamw8-fsdp-resumed   warm   FSDP2              lora-adamw8-fsdp resumed from its step-3 checkpoint

The resume runs `warm` (tests/warm_launch.py): what it tests is the restored 8-bit state, not its launcher;
FSDP2 with adamw_8bit keeps its real `torchrun` launch (lora-adamw8-fsdp).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from launch_helpers import (
    Launch,
    RunResult,
    run_and_resume,
    varied_length_data,
    write_config,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, EVERY = 6, 3
MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep 32-bit optimizer state
QUANT_STATE = "__bnb_optimizer_quant_state__"  # where bitsandbytes' state_dict() nests its state tensors
RUNS = [  # the slowest (DeepSpeed start-up) first
    Launch(
        "lora-adamw8-zero2",
        "torchrun",  # DeepSpeed under torchrun
        ("distributed.preset=zero2", "optimizer.name=adamw_8bit", "train.activation_checkpointing=true"),
    ),
    Launch("lora-adamw8-fsdp", "torchrun", ("distributed.strategy=fsdp", "optimizer.name=adamw_8bit")),
    Launch(
        "qlora-paged-single",
        "api",
        (
            "distributed.strategy=single",
            "quantization.load_in=4bit",
            "optimizer.name=paged_adamw_8bit",
            "train.activation_checkpointing=true",
        ),
    ),
    Launch(
        "lora8bit-lion-single",
        "api",
        ("distributed.strategy=single", "quantization.load_in=8bit", "optimizer.name=lion_8bit"),
    ),
]
RESUMED = "lora-adamw8-fsdp-resumed"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("memory")
    data = varied_length_data(root / "eight.jsonl", 8, seed=3)
    return write_config(
        root / "memory.yaml",
        {
            "seed": 11,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "train": {"max_steps": STEPS, "precision": "bf16"},
            "optimizer": {"lr": 3e-3},
            "scheduler": {"name": "constant"},
            # r=64: most adapter matrices reach bitsandbytes' 4096-element threshold for 8-bit state.
            "lora": {"enabled": True, "r": 64, "alpha": 64, "dropout": 0.1},
            "data": {"path": str(data), "max_seq_len": 64},
            "checkpoint": {"every_steps": EVERY, "keep_last": 2},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )


@pytest.fixture(scope="module")
def runs(config: Path) -> dict[str, RunResult]:
    resumed, warm = {"lora-adamw8-fsdp": RESUMED}, {RESUMED: "warm"}
    return run_and_resume(RUNS, config, config.parent / "runs", resumed, EVERY, STEPS, launchers=warm)


# --- reading what each strategy wrote into checkpoints/step-N/ ---------------------------------------------


def _last_checkpoint(run: RunResult) -> Path:
    return run.run_dir / "checkpoints" / f"step-{STEPS}"


def _dcp_metadata(folder: Path) -> dict[str, Any]:
    """DCP's metadata (key -> storage metadata with dtype and global size); needs no process group."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata


def _state_tensors(run: RunResult) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, elements) of every optimizer state1/state2 tensor in the last checkpoint.

    single: `state.pt`; DeepSpeed: the base optimizer's state in each rank's ZeRO partition file (one flat
    partition per group); FSDP: DCP metadata (global size, sharded over the ranks).
    """
    folder, found = _last_checkpoint(run), []
    if (folder / "state.pt").is_file():
        states = torch.load(folder / "state.pt", weights_only=False)["optimizer"]["state"]
        for index, state in states.items():
            for key in ("state1", "state2"):
                if key in state[QUANT_STATE]:
                    tensor = state[QUANT_STATE][key]
                    found.append((f"{index}.{key}", tensor.dtype, tensor.numel()))
    elif (folder / "engine").is_dir():
        for part in sorted((folder / "engine").glob("*zero_pp_rank_*_optim_states.pt")):
            base = torch.load(part, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
            for index, state in base["state"].items():
                for key in ("state1", "state2"):
                    if key in state[QUANT_STATE]:
                        tensor = state[QUANT_STATE][key]
                        found.append((f"{part.name}:{index}.{key}", tensor.dtype, tensor.numel()))
    else:
        for key, meta in _dcp_metadata(folder).items():
            if key.startswith("optim.state.") and key.endswith((".state1", ".state2")):
                found.append((key, meta.properties.dtype, meta.size.numel()))
    return found


def _checkpointed_weights(run: RunResult) -> set[str]:
    """Names of the model weights in the last checkpoint (peft's `.default` adapter name dropped)."""
    folder = _last_checkpoint(run)
    if (folder / "state.pt").is_file():
        names = torch.load(folder / "state.pt", weights_only=False)["model"].keys()
    elif (folder / "engine").is_dir():
        names = torch.load(folder / "engine" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    else:
        names = [k.removeprefix("model.") for k in _dcp_metadata(folder) if k.startswith("model.")]
    return {name.replace(".default", "") for name in names}


# --- tests --------------------------------------------------------------------------------------------------

NAMES = [launch.name for launch in RUNS]


@pytest.mark.parametrize("name", NAMES)
def test_trains_and_loss_falls(runs: dict[str, RunResult], name: str) -> None:
    losses = runs[name].check().series("loss")
    assert len(losses) == STEPS
    assert all(torch.isfinite(torch.tensor(losses))), losses
    first, last = statistics.mean(losses[:2]), statistics.mean(losses[-2:])
    assert last < first - 0.2, losses


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_state_in_the_checkpoint_is_8bit(runs: dict[str, RunResult], name: str) -> None:
    tensors = _state_tensors(runs[name].check())
    assert tensors, "no optimizer state found in the checkpoint"
    wrong = [(n, d, size) for n, d, size in tensors if (d == torch.uint8) != (size >= MIN_8BIT_SIZE)]
    assert not wrong, wrong
    assert sum(d == torch.uint8 for _, d, _ in tensors) >= len(tensors) / 2, tensors


@pytest.mark.parametrize("name", NAMES)
def test_only_adapters_train_and_are_exported(runs: dict[str, RunResult], name: str) -> None:
    run = runs[name].check()
    assert not (run.run_dir / "model").exists()
    exported = run.exported()  # adapter/adapter_model.safetensors
    assert exported and all("lora_" in key for key in exported), sorted(exported)
    # The checkpoint holds exactly the trained weights: the adapters, no frozen base weight.
    assert _checkpointed_weights(run) == set(exported)
    # LoRA B starts at zero: a nonzero B everywhere means every adapter was updated.
    untrained = [k for k, v in exported.items() if "lora_B" in k and not v.abs().sum() > 0]
    assert not untrained, untrained
    config = json.loads((run.run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 64


def test_plan_names_the_quantized_method(runs: dict[str, RunResult]) -> None:
    qlora = runs["qlora-paged-single"].check()
    assert "qlora" in qlora.stdout
    assert "lora-8bit" in runs["lora8bit-lion-single"].check().stdout
    if not torch.cuda.is_available():  # nothing to page without a GPU: the fallback is said, not silent
        assert "using non-paged AdamW8bit" in qlora.stderr


def test_fsdp_8bit_resume_continues_exactly(runs: dict[str, RunResult]) -> None:
    straight, resumed = runs["lora-adamw8-fsdp"].check(), runs[RESUMED].check()
    assert f"checkpoints/step-{EVERY} at step {EVERY} of {STEPS}" in resumed.stdout
    a, b = straight.series("loss"), resumed.series("loss")
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-6, (a, b)
