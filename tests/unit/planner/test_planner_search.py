"""Will it fit: GPU catalogue, `micro_batch_size=auto`, remedies, the shipped recipes, and `zerofit plan`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from config_helpers import DEMO_DATA, config
from zerofit.catalogue.gpus import get_gpu, gpu_from_device_name, gpu_peak_tflops, parse_memory_gib
from zerofit.cli import main
from zerofit.config import ZerofitConfig, load_config
from zerofit.core.errors import ConfigError
from zerofit.engine_spec import render_spec
from zerofit.planner import choose_fastest_plan
from zerofit.planner.search.budget import resolve_budget
from zerofit.planner.search.report import plan_memory
from zerofit.planner.search.table import divisors
from zerofit.resolution import resolve

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "configs").glob("*.yaml"))
L7 = "meta-llama/Llama-2-7b-hf"


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # Plans here must not depend on whatever GPU the test machine might have.
    monkeypatch.setattr("zerofit.planner.search.budget.detected_gpu", lambda: None)


def _cfg(**sections: dict[str, Any]) -> ZerofitConfig:
    base = {
        "model": {"name_or_path": L7},
        "data": {"path": DEMO_DATA, "max_seq_len": 1024},
        "distributed": {"strategy": "deepspeed", "preset": "zero2"},
        "train": {"activation_checkpointing": True},
        "logging": {"wandb": {"mode": "disabled"}},
    }
    return config(base, **sections)


# ----------------------------------------------------------------------------------------- GPUs


def test_gpu_catalogue_memory_parsing_and_device_names() -> None:
    assert get_gpu("RTX3090") == get_gpu("rtx3090")  # names are case-insensitive
    assert parse_memory_gib("24GiB") == 24.0
    assert parse_memory_gib("24576MiB") == 24.0
    assert parse_memory_gib("24GB") == pytest.approx(24e9 / 2**30)
    assert parse_memory_gib("16") == 16.0
    assert gpu_from_device_name("NVIDIA GeForce RTX 3090").name == "rtx3090"
    assert gpu_from_device_name("NVIDIA A100-SXM4-80GB", 79.2).name == "a100-80gb"
    assert gpu_from_device_name("NVIDIA A100-SXM4-40GB", 39.4).name == "a100-40gb"
    assert gpu_from_device_name("NVIDIA H100 PCIe").name == "h100-pcie"
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == gpu_peak_tflops(
        "a100-80gb"
    )  # a device name finds its card
    for bad in ("24 parsecs", "-3GiB"):
        with pytest.raises(ConfigError):
            parse_memory_gib(bad)
    with pytest.raises(ConfigError, match="not in the catalogue"):
        get_gpu("gtx1080")


# ----------------------------------------------------------------------------------------- auto


def test_auto_picks_the_largest_fitting_divisor_and_keeps_the_global_batch() -> None:
    cfg = _cfg(batch={"global_batch_size": 24, "micro_batch_size": "auto"}, planner={"gpu_memory_gib": 20.0})
    resolved = resolve(cfg, 2, choose_fastest_plan)
    plan = resolved.batch
    assert plan.global_batch_size == 24 and plan.micro_batch_size in divisors(12)
    assert plan.micro_batch_size * plan.grad_accum_steps * plan.dp_size == 24
    table = plan_memory(resolved, render_spec(resolved), resolve_budget(resolved.config)).table
    fitting = [row.micro_batch_size for row in table if row.verdict == "fits"]
    assert plan.micro_batch_size == max(fitting) and max(fitting) < 12  # something bigger did not fit
    assert resolved.config.batch.micro_batch_size == plan.micro_batch_size  # no `auto` left


def test_auto_without_a_budget_or_with_nothing_fitting_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"planner\.gpu"):
        resolve(_cfg(batch={"global_batch_size": 8, "micro_batch_size": "auto"}), 1, choose_fastest_plan)
    cfg = _cfg(batch={"global_batch_size": 8, "micro_batch_size": "auto"}, planner={"gpu": "rtx4080"})
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 1, choose_fastest_plan)
    message = str(err.value)
    assert "not even micro-batch 1 fits" in message and "QLoRA" in message and "GiB" in message


# ----------------------------------------------------------------------------------------- remedies


def test_a_config_that_cannot_fit_gets_every_remedy_with_its_peak() -> None:
    cfg = _cfg(
        batch={"global_batch_size": 16, "micro_batch_size": 1},
        lora={"enabled": False},
        train={"activation_checkpointing": False},
        distributed={"strategy": "single", "preset": None},
    )
    resolved = resolve(cfg, 1, choose_fastest_plan)
    plan = plan_memory(resolved, render_spec(resolved), resolve_budget(resolved.config, gpu="rtx3090"))
    assert plan.verdict == "does not fit" and plan.fits is False
    names = [r.name for r in plan.remedies]
    for expected in ("activation checkpointing", "LoRA", "8-bit", "QLoRA", "offload", "more GPUs"):
        assert any(expected in n for n in names), names
    by_name = {r.name: r for r in plan.remedies}
    assert all(r.total_gib > 0 for r in plan.remedies)
    assert by_name["QLoRA: 4-bit base weights, one process"].verdict == "fits"
    offload = by_name["offload to CPU (DeepSpeed ZeRO-3 offload)"]
    assert offload.verdict == "fits" and offload.host_ram_gib > 100  # full 7B state on the host
    assert by_name["activation checkpointing"].verdict == "does not fit"  # 16 B/param is the problem


def test_each_remedy_typed_as_shown_plans_to_its_predicted_peak(tmp_path: Path) -> None:
    """A remedy is its override strings: the user who types the `how` shown (at the remedy's micro-batch)
    gets the very peak the remedy predicted."""
    cfg = _cfg(
        batch={"global_batch_size": 16, "micro_batch_size": 1},
        lora={"enabled": False},
        train={"activation_checkpointing": False},
        distributed={"strategy": "single", "preset": None},
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    budget = resolve_budget(cfg, gpu="rtx3090")
    assert budget is not None
    resolved = resolve(cfg, 1, choose_fastest_plan)
    remedies = plan_memory(resolved, render_spec(resolved), budget).remedies
    # Those shown as plain overrides (not a launch change, a choice between two, or the combination).
    typed = [r for r in remedies if all("=" in word for word in r.how.split())]
    assert {r.name for r in typed} >= {"activation checkpointing", "LoRA instead of full fine-tuning"}
    for remedy in typed:
        overrides = [*remedy.how.split(), f"batch.micro_batch_size={remedy.micro_batch_size}"]
        what_if = resolve(load_config(path, overrides), 1, choose_fastest_plan)
        plan = plan_memory(what_if, render_spec(what_if), budget)
        assert plan.estimate.total_gib == pytest.approx(remedy.total_gib), remedy.name


def test_remedies_are_runs_resolve_accepts() -> None:
    """Each remedy is the run `resolve()` makes of its overrides: a one-process QLoRA config is offered no
    "more GPUs" as it is (a one-process run cannot be launched on several ranks), only what it could run:
    more GPUs on DeepSpeed, with the sequence shared (a QLoRA base is not sharded by ZeRO-3)."""
    cfg = load_config(
        str(REPO / "configs" / "llama2-7b-qlora-3090.yaml"),
        ["data.max_seq_len=4096", "batch.micro_batch_size=2"],
    )
    resolved = resolve(cfg, 1, choose_fastest_plan)
    plan = plan_memory(resolved, render_spec(resolved), resolve_budget(resolved.config, gpu="rtx4080"))
    assert plan.verdict == "does not fit" and plan.remedies
    more = [r for r in plan.remedies if r.name.startswith("more GPUs")]
    assert [r.name for r in more] == ["more GPUs: 2 with sequence parallelism 2"], [r.name for r in more]
    assert (
        "distributed.strategy=deepspeed distributed.preset=zero2 distributed.sequence_parallel=2"
        in more[0].how
    )


# ----------------------------------------------------------------------------------------- recipes


# The demos (`demo`, `demo-chat`) train the CPU-sized tiny model anywhere; every other shipped config is a
# recipe for a GPU.
GPU_RECIPES = [p for p in RECIPES if not p.stem.startswith("demo")]


@pytest.mark.parametrize("path", GPU_RECIPES, ids=[p.stem for p in GPU_RECIPES])
def test_every_shipped_config_fits_its_stated_gpu_with_headroom(path: Path) -> None:
    cfg = load_config(str(path), [])
    assert cfg.planner.gpu is not None, f"{path.name} must state its target GPU (planner.gpu)"
    resolved = resolve(cfg, cfg.planner.num_gpus, choose_fastest_plan)
    budget = resolve_budget(resolved.config, detect=False)
    plan = plan_memory(resolved, render_spec(resolved), budget)
    assert plan.verdict == "fits", plan.as_dict()["breakdown"]
    assert budget.gib - plan.estimate.total_gib >= budget.gib * budget.headroom


def test_the_four_3090_recipes_are_shipped() -> None:
    names = {p.stem for p in RECIPES}
    assert {
        "llama2-7b-lora-3090",
        "llama2-7b-qlora-3090",
        "llama3-8b-qlora-3090",  # Llama-3 QLoRA has its own recipe and run_name, not Llama-2's
        "llama2-7b-full-zero3-offload-3090",
        "mistral-7b-lora-2x3090-fsdp",
    } <= names


# ----------------------------------------------------------------------------------------- CLI


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_has_the_memory_verdict_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    memory = _plan_json(
        capsys, "--config", str(REPO / "configs" / "llama2-7b-lora-3090.yaml"), "--gpu", "rtx3090"
    )["memory"]
    assert memory["fits"] is True and memory["verdict"] == "fits"
    assert sum(memory["breakdown"].values()) == pytest.approx(memory["tensors_gib"], abs=0.01)
    assert memory["total_gib"] > memory["tensors_gib"]
    assert memory["gpu"]["name"] == "rtx3090" and memory["headroom_gib"] > 0
    assert [r["micro_batch_size"] for r in memory["micro_batch_table"]] == [1, 2, 4, 8, 16, 32]


@pytest.mark.slow
def test_plan_trace_on_the_demo_agrees_with_the_analytic_model(capsys: pytest.CaptureFixture[str]) -> None:
    memory = _plan_json(
        capsys, "--config", str(REPO / "configs" / "demo.yaml"), "--gpu-mem", "8GiB", "--trace"
    )["memory"]
    assert memory["gpu"]["memory_gib"] == 8.0
    assert abs(memory["trace"]["analytic_vs_trace"]) < 0.05


def test_plan_probe_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --probe would run real steps")
    assert main(["plan", "--config", str(REPO / "configs" / "demo.yaml"), "--probe"]) != 0
    assert "no CUDA device" in capsys.readouterr().err
