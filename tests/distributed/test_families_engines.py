"""Built-in families on 2 gloo ranks through the real launchers: DeepSpeed ZeRO-2 and FSDP2, LoRA
all-linear (the MoE models with every routed expert and the router trained), 2 steps each; every run's
adapter exported, merged, and generated from. One run per engine starts through a real launcher (Qwen3
QLoRA on ZeRO-2 under the `deepspeed` runner, Qwen3 LoRA on FSDP2 under `torchrun`); the others' ranks run
`warm` (tests/warm_launch.py), the launchers' own behaviour being covered (ZeRO-2 under `torchrun`:
test_equivalence's zero2 and the other equivalence modules).

Every held-out-style family of the issue (Qwen3, Gemma-3, Phi-3, Mixtral, Qwen3-MoE) and the MoE recipe's
tiny twin (Qwen2-MoE, the class of configs/qwen15-moe-qlora-2x3090-fsdp.yaml) runs on BOTH engines: 12
launches. The covering design (Q = QLoRA: 4-bit bitsandbytes base, bf16; L = LoRA, fp32):

    family       ZeRO-2  FSDP2        each family: LoRA on one engine, QLoRA on the other
    Qwen3          Q       L          each engine: dense LoRA and dense QLoRA,
    Gemma-3        Q       L                       MoE LoRA and MoE QLoRA
    Phi-3          L       Q          ZeRO-2 dense: Qwen3 Q, Gemma-3 Q, Phi-3 L;   MoE: Mixtral L, Qwen3-MoE Q,
    Mixtral        L       Q                        Qwen2-MoE Q
    Qwen3-MoE      Q       L          FSDP2  dense: Qwen3 L, Gemma-3 L, Phi-3 Q;   MoE: Mixtral Q, Qwen3-MoE L,
    Qwen2-MoE      Q       L                        Qwen2-MoE L

Every run is exported twice through `zerofit export` (its adapter as a peft folder, and `--merge`d into its
base: a QLoRA base dequantized, saved in bf16) and generated from through `zerofit generate`: a LoRA run from
its adapter folder (the base rebuilt by the export's record), a QLoRA run from its merged model, so every
family generates from both kinds of export. Export and generate run in this process on the CPU (a tiny model:
a second or two each). One launch per run: launches cannot be shared (DeepSpeed's CPU shared-memory comm
cannot be initialized twice in one process, and a second FSDP2 run in one torchrun launch was seen to hang
at its process-group set-up). Every family also trains with LoRA and with QLoRA on one process, and is
exported and generated from, in tests/unit/models/test_families.py.

    launch                   launcher    engine
    zero2-qlora-tiny-qwen3   deepspeed   DeepSpeed ZeRO-2 under the `deepspeed` runner
    zero2-*                  warm        DeepSpeed ZeRO-2, the other families (`zero2-lora-FAMILY`,
                                         `zero2-qlora-FAMILY`)
    fsdp-lora-tiny-qwen3     torchrun    FSDP2 under `torchrun`
    fsdp-*                   warm        FSDP2, the other families
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launch_helpers import REPO, Launch, RunResult, run_launches, write_config
from zerofit.cli import main as cli
from zerofit.config import load_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MOE = {"tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe"}
LAYER_CLASS = {
    "tiny-qwen3": "Qwen3DecoderLayer",
    "tiny-gemma3": "Gemma3DecoderLayer",
    "tiny-phi3": "Phi3DecoderLayer",
    "tiny-mixtral": "MixtralDecoderLayer",
    "tiny-qwen3-moe": "Qwen3MoeDecoderLayer",
    "tiny-qwen2-moe": "Qwen2MoeDecoderLayer",
}
# The design of the module docstring: family -> the engine its QLoRA run is on (LoRA on the other one).
QLORA_ON = {
    "tiny-qwen3": "zero2",
    "tiny-gemma3": "zero2",
    "tiny-phi3": "fsdp",
    "tiny-mixtral": "fsdp",
    "tiny-qwen3-moe": "zero2",
    "tiny-qwen2-moe": "zero2",
}
ENGINES = ("zero2", "fsdp")  # ZeRO-2 first: its launches are the longer ones
# The runs through real launchers, one per engine: ZeRO-2 under `deepspeed`, FSDP2 under `torchrun`.
REAL_LAUNCHER = {
    "zero2-qlora-tiny-qwen3": "deepspeed",
    "fsdp-lora-tiny-qwen3": "torchrun",
}
# A launch is CPU-bound start-up (imports, engine init: ~20 s of 2 ranks alone on 2 cores, ZeRO-2 ~6 s more
# for its launcher and shared-memory comm op), so about two cores per launch; on 2 cores the 12 launches
# took 148 s at 2 at a time, 162 s at 3 and 181 s at 4 (a shared machine, one measurement each).
PARALLEL = max(2, min(6, (os.cpu_count() or 2) // 2))
# run name -> (engine, family, quantized)
RUNS = {
    f"{engine}-{'qlora' if QLORA_ON[name] == engine else 'lora'}-{name}": (
        engine,
        name,
        QLORA_ON[name] == engine,
    )
    for engine in ENGINES
    for name in LAYER_CLASS
}


def test_the_matrix_covers_both_methods_per_family_and_per_engine_and_kind() -> None:
    """The design the docstring states: each family LoRA on one engine and QLoRA on the other; each engine
    both methods for dense and for MoE families."""
    for name in LAYER_CLASS:
        assert sorted(q for e, n, q in RUNS.values() if n == name) == [False, True], name
    for engine in ENGINES:
        for moe in (False, True):
            methods = {q for e, n, q in RUNS.values() if e == engine and (n in MOE) == moe}
            assert methods == {False, True}, (engine, moe)


def _launch(run_name: str) -> Launch:
    engine, name, quantized = RUNS[run_name]
    strategy = ["distributed.strategy=deepspeed"] if engine == "zero2" else ["distributed.strategy=fsdp"]
    moe = ["lora.moe_experts=all", "lora.train_router=true"] if name in MOE else []
    qlora = ["quantization.load_in=4bit", "train.precision=bf16"] if quantized else []
    overrides = (f"model.name_or_path={name}", *strategy, f"distributed.preset={engine}", *moe, *qlora)
    # One run per engine through its real launcher (REAL_LAUNCHER); the rest warm: their ranks would only
    # import again what those launches' ranks import (~13 CPU-s a launch, ~5 more under `deepspeed`).
    return Launch(run_name, REAL_LAUNCHER.get(run_name, "warm"), overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    out = tmp_path_factory.mktemp("families")
    config = write_config(
        out / "config.yaml",
        {
            "seed": 0,
            "batch": {"global_batch_size": 2, "micro_batch_size": 1},
            "train": {"max_steps": 2, "precision": "fp32"},
            "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"},
            "data": {"path": str(REPO / "data" / "demo_chat.jsonl"), "max_seq_len": 64},
            "logging": {"wandb": {"mode": "disabled"}},
        },
    )
    return run_launches([_launch(name) for name in RUNS], config, out / "runs", max_parallel=PARALLEL)


@pytest.mark.parametrize("run_name", list(RUNS))
def test_family_trains_on_two_ranks(runs: dict[str, RunResult], run_name: str) -> None:
    """Two finite steps on the engine asked for, the adapter saved, the plan's lora line, a 4-bit base for
    QLoRA; FSDP2 shards the model's own decoder-layer class."""
    engine, name, quantized = RUNS[run_name]
    result = runs[run_name].check()
    losses = [row["loss"] for row in result.metrics if "loss" in row]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert (result.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert "  lora         " in result.stdout and "all-linear" in result.stdout
    config = load_config(result.run_dir / "config.yaml")
    assert config.distributed.strategy == ("deepspeed" if engine == "zero2" else "fsdp")
    assert config.quantization.load_in == ("4bit" if quantized else "none")
    if engine == "fsdp":
        wrap = json.loads((result.run_dir / "fsdp.json").read_text())["wrap"]
        assert wrap["layer_class"] == LAYER_CLASS[name]


@pytest.mark.parametrize("run_name", list(RUNS))
def test_family_run_exports_merged_and_generates(
    runs: dict[str, RunResult], run_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`zerofit export` (the adapter) and `zerofit export --merge` of the 2-rank run, then `zerofit generate`
    from the adapter folder (LoRA) or the merged model (QLoRA), all through the CLI."""
    _, _, quantized = RUNS[run_name]
    run_dir = runs[run_name].check().run_dir
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert cli(["export", str(run_dir), "--out", str(adapter)]) == 0
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    assert cli(["export", str(run_dir), "--merge", "--out", str(merged)]) == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    capsys.readouterr()
    source = merged if quantized else adapter
    assert cli(["generate", str(source), "--prompt", "add: 2+2", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    # A random model may end at once (eos first): generate says so rather than printing nothing silently.
    assert out.strip() or "the continuation is empty" in err
    assert "Traceback" not in err
