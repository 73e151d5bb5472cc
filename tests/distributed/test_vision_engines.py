"""Vision-language models on 2 ranks: tiny-qwen2-vl, LoRA on the language model with the projector
trained in full, on the bundled ragged image + text data (images of different sizes, text-only rows), fp32,
global batch 4, the tiny-qwen2-vl 2-rank runs through the real launchers (gloo), the other families' `warm`
(tests/warm_launch.py):

    launch          launcher    engine            split (micro x accum x dp)
    single          api         one process       4 x 1 x 1   (the Python API, `zerofit.train`, in the test process)
    zero2           deepspeed   DeepSpeed ZeRO-2  1 x 2 x 2
    fsdp            torchrun    FSDP2             1 x 2 x 2   (the vision blocks and the decoder layers each sharded)
    *-single        api         one process       4 x 1 x 1   each other family's reference (below)
    gemma3-fsdp     warm        FSDP2             1 x 2 x 2   tiny-gemma3-vl
    llava-fsdp      warm        FSDP2             1 x 2 x 2   tiny-llava
    smolvlm-zero2   warm        DeepSpeed ZeRO-2  1 x 2 x 2   tiny-smolvlm
    mllama-fsdp     warm        FSDP2             1 x 2 x 2   tiny-mllama (cross-attention images)

A rank whose micro-batch has no image still runs the vision tower (`models.vision.run_vision_every_step`), so
the sharded engines' collectives match. The per-step loss agrees within 2e-5 and every run exports its adapter.
The other families (`FAMILY_CASES`: tiny-gemma3-vl and tiny-llava on FSDP2, tiny-smolvlm on ZeRO-2) each run
the same settings once on one process (in the test process, as `single`) and once on 2 ranks, in the same
concurrent launches.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_helpers import REPO, Launch, RunResult, run_launches

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 2e-5
COMMON = ("train.max_steps=4", "lora.projector=full", "logging.wandb.mode=disabled")
ZERO2 = ("distributed.strategy=deepspeed", "distributed.preset=zero2", "batch.micro_batch_size=1")
LAUNCHES = [
    Launch("single", "api", (*COMMON, "distributed.strategy=single", "batch.micro_batch_size=4")),
    Launch("zero2", "deepspeed", (*COMMON, *ZERO2)),
    Launch("fsdp", "torchrun", (*COMMON, "distributed.strategy=fsdp", "batch.micro_batch_size=1")),
]
# The other families, each on one engine against its own one-process curve: (label, model, engine). FSDP2
# shards the blocks the model's classes declare whole (`_no_split_modules`; for Gemma 3 and LLaVA those of its
# vision tower's and language model's classes: SigLIP / CLIP encoder layers and the decoder layers).
ENGINES = {"zero2": ZERO2, "fsdp": ("distributed.strategy=fsdp", "batch.micro_batch_size=1")}
FAMILY_CASES = [
    ("gemma3", "tiny-gemma3-vl", "fsdp"),
    ("smolvlm", "tiny-smolvlm", "zero2"),
    ("llava", "tiny-llava", "fsdp"),
]
for _label, _model, _engine in FAMILY_CASES:
    _common = (*COMMON, f"model.name_or_path={_model}")
    LAUNCHES += [
        Launch(
            f"{_label}-single",
            "api",
            (*_common, "distributed.strategy=single", "batch.micro_batch_size=4"),
        ),
        Launch(f"{_label}-{_engine}", "warm", (*_common, *ENGINES[_engine])),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    out = tmp_path_factory.mktemp("vision-engines")
    results = run_launches(LAUNCHES, REPO / "configs" / "demo-vlm.yaml", out, max_parallel=3)
    return {name: result.check() for name, result in results.items()}


@pytest.mark.parametrize("engine", ["zero2", "fsdp"])
def test_two_ranks_give_the_one_process_curve(runs: dict[str, RunResult], engine: str) -> None:
    single, other = runs["single"].series("loss"), runs[engine].series("loss")
    assert len(single) == len(other) == 4
    assert other == pytest.approx(single, abs=TOL)
    assert runs[engine].series("tokens") == runs["single"].series("tokens")
    assert (runs[engine].run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert Path(runs[engine].run_dir / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize(("label", "model", "engine"), FAMILY_CASES)
def test_each_family_on_two_ranks_gives_its_one_process_curve(
    runs: dict[str, RunResult], label: str, model: str, engine: str
) -> None:
    single, other = runs[f"{label}-single"], runs[f"{label}-{engine}"]
    assert len(single.series("loss")) == 4
    assert other.series("loss") == pytest.approx(single.series("loss"), abs=TOL)
    assert other.series("tokens") == single.series("tokens")
    assert (other.run_dir / "adapter" / "adapter_model.safetensors").is_file()


# Llama 3.2 Vision (tiny-mllama) on FSDP2: the engine whose per-block collectives a rank without images would
# break (transformers skips the cross-attention layers and the vision tower then; zerofit gives such a forward
# a padding image, `models.mllama`), with the vision encoder layers and both decoder layer kinds (self- and
# cross-attention) sharded from `_no_split_modules`. ZeRO-2 shards no weights, so it adds nothing here.
MLLAMA = (*COMMON, "model.name_or_path=tiny-mllama", "data.max_image_tokens=null")
LAUNCHES += [
    Launch("mllama-single", "api", (*MLLAMA, "distributed.strategy=single", "batch.micro_batch_size=4")),
    Launch("mllama-fsdp", "warm", (*MLLAMA, "distributed.strategy=fsdp", "batch.micro_batch_size=1")),
]


def test_llama_3_2_vision_on_fsdp2_gives_the_one_process_curve(runs: dict[str, RunResult]) -> None:
    single, fsdp = runs["mllama-single"].series("loss"), runs["mllama-fsdp"].series("loss")
    assert len(single) == len(fsdp) == 4
    assert fsdp == pytest.approx(single, abs=TOL)
    assert runs["mllama-fsdp"].series("tokens") == runs["mllama-single"].series("tokens")
    assert (runs["mllama-fsdp"].run_dir / "adapter" / "adapter_model.safetensors").is_file()
