"""The planner on vision-language models: the vision tower's weights, the image tokens of the data (or the
worst case), the images' terms, and the analytic model against the FakeTensor trace at the Qwen2.5-VL-7B shape
(images fed to the traced model, the tower's depth extrapolated)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerofit.planner.estimate import estimate
from zerofit.planner.images import ImageRows, image_tokens, observed_images, rows_from_sizes, worst_case_rows
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import lora_shape, model_shape

QWEN_VL = "Qwen/Qwen2.5-VL-7B-Instruct"
MLLAMA = "meta-llama/Llama-3.2-11B-Vision-Instruct"
REPO = Path(__file__).resolve().parents[3]


def _scn(**kw: object) -> Scenario:
    base = {"model": QWEN_VL, "seq_len": 1024, "micro_batch_size": 1, "activation_checkpointing": True,
            "images": worst_case_rows(QWEN_VL, 1024, 1024)}  # fmt: skip
    return Scenario(**{**base, **kw})  # type: ignore[arg-type]


def test_qwen25_vl_7b_shape_counts_its_language_model_and_its_tower() -> None:
    shape = model_shape(QWEN_VL)
    assert (shape.hidden_size, shape.num_layers, shape.num_kv_heads) == (3584, 28, 4)  # the language model's
    assert shape.total_params == 8_292_166_656  # the hub checkpoint's count
    assert (shape.vision_params, shape.projector_params) == (631_975_680, 44_574_464)
    big = model_shape(MLLAMA)
    assert big.hidden_size == 4096 and big.num_layers == 40 and big.is_vision


def test_lora_adapts_the_language_model_only_unless_the_tower_is_asked_for() -> None:
    text = lora_shape(QWEN_VL, 16)
    tower = lora_shape(QWEN_VL, 16, vision_tower=True)
    projector = lora_shape(QWEN_VL, 16, projector="full")
    assert text.trainable_params == 40_370_176  # r=16 on the 7 linears of 28 layers
    assert tower.trainable_params > text.trainable_params
    assert projector.trainable_params == text.trainable_params + model_shape(QWEN_VL).projector_params


def test_image_tokens_follow_the_processor_rule() -> None:
    assert image_tokens(QWEN_VL, 448, 448, None) == 256  # 16 x 16 squares of 28 pixels
    assert image_tokens(QWEN_VL, 4000, 3000, 1024) <= 1024  # data.max_image_tokens resizes it
    assert image_tokens(QWEN_VL, 10, 10, None) == 4  # the processor's fewest pixels (56 x 56)
    assert image_tokens(MLLAMA, 100, 100, None) == 4 * 1601  # 4 tiles of 40 x 40 patches + a class token


def test_the_worst_micro_batch_is_the_rows_with_the_most_image_tokens() -> None:
    rows = rows_from_sizes(QWEN_VL, [[(448, 448)], [], [(448, 448), (224, 224)], [(56, 56)]], None, "data")
    assert rows.row_tokens == (320, 256, 4, 0)
    assert (rows.micro_batch(1), rows.micro_batch(2), rows.largest_image) == (320, 576, 256)
    worst = worst_case_rows(QWEN_VL, 2048, 1024)
    assert worst.micro_batch(3) == 3 * 2048 and worst.largest_image == 1024 and "worst case" in worst.source


def test_the_frozen_tower_is_counted_in_the_weights_and_a_trained_one_saves_activations() -> None:
    frozen = estimate(_scn())
    assert frozen.breakdown["frozen base weights (bf16)"] * 2**30 == pytest.approx(8_292_166_656 * 2)
    assert any("vision tower (631,975,680 params)" in note for note in frozen.notes)
    assert any("worst case" in note for note in frozen.notes)
    trained = estimate(_scn(lora_vision_tower=True))
    assert trained.tensors_gib > frozen.tensors_gib + 0.1
    assert any("vision blocks' checkpointed inputs" in k for k in trained.breakdown)
    few = estimate(_scn(images=ImageRows((64,), 64, "data")))
    assert few.as_dict()["image_tokens"]["micro_batch"] == 64


def test_llama_32_vision_counts_its_cross_attention_states() -> None:
    # Full fine-tuning: LoRA's placement for mllama comes with its family (`models.vision.FAMILIES`).
    scn = Scenario(model=MLLAMA, lora=False, seq_len=2048, micro_batch_size=1, activation_checkpointing=True,
                   images=worst_case_rows(MLLAMA, 2048, None))  # fmt: skip
    from zerofit.planner.activations.vision import vision_terms

    held = vision_terms(scn).held
    states = 4 * 1601  # one image per row, every tile (not in the text sequence: cross-attended)
    assert (
        held[f"cross-attention keys/values (8 layers x {states} image tokens)"] == 8 * 2 * states * 1024 * 2
    )


def test_plan_reads_the_data_image_sizes() -> None:
    from zerofit.config import load_config
    from zerofit.data.image_rows import plan_images

    cfg = load_config(
        REPO / "configs" / "qwen25-vl-7b-lora-3090.yaml", [f"data.path={REPO / 'data/demo-vlm.jsonl'}"]
    )
    rows = plan_images(cfg)
    assert rows is not None and "10 rows, 6 images" in rows.source
    with observed_images(rows):
        from zerofit.planner.images import planned_images

        assert planned_images(QWEN_VL, 2048, 1024) is rows


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_analytic_within_5_percent_of_trace_at_qwen25_vl_7b(quantization: str) -> None:
    # LoRA / QLoRA on one GPU, every block checkpointed, 2048 image tokens (8192 patches through the tower).
    scn = _scn(seq_len=2048, images=worst_case_rows(QWEN_VL, 2048, 1024), quantization=quantization)
    from zerofit.planner.trace import trace_memory

    traced = trace_memory(scn)
    assert len(traced.layers) == 3  # 1 and 2 decoder layers, and 2 vision blocks: each increment extrapolated
    predicted = estimate(scn).tensors_gib
    assert abs(predicted / traced.tensors_gib - 1) < 0.05, (predicted, traced.as_dict())


@pytest.mark.slow
def test_the_trace_feeds_images_to_qwen2_vl_and_extrapolates_its_tower() -> None:
    # The built-in tiny Qwen2-VL (whole-image attention, no windows), fp32, 2 rows of 16 and 8 image tokens.
    from zerofit.planner.trace import trace_memory

    scn = Scenario(model="tiny-qwen2-vl", seq_len=64, micro_batch_size=2, precision="fp32",
                   activation_checkpointing=True, images=ImageRows((16, 8), 16, "data"))  # fmt: skip
    traced = trace_memory(scn)
    assert [t.label for t in traced.layers] == [
        "1 + 1 vision block(s)",
        "2 + 1 vision block(s)",
        "1 + 2 vision block(s)",
    ]
    assert traced.layers[2].peak_bytes > traced.layers[0].peak_bytes  # a vision block's weights and input
    assert abs(estimate(scn).tensors_gib / traced.tensors_gib - 1) < 0.05


def test_the_planners_resize_rule_is_transformers_qwen_vl_rule() -> None:
    # The plan counts image tokens without importing transformers' image processing (~3 CPU-s): its copy of
    # Qwen-VL's `smart_resize` must give transformers' answer for every size and limit, on any version.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    from zerofit.planner.images import smart_resize

    sides = (1, 7, 27, 28, 29, 56, 100, 333, 448, 640, 1000, 1023, 2048, 4000, 5000)
    limits = ((56 * 56, 28 * 28 * 1280), (3136, 12845056), (28 * 28, 28 * 28 * 4), (200_000, 200_000))
    for factor in (14, 28, 32):
        for least, most in limits:
            for h in sides:
                for w in sides:
                    if max(h, w) / min(h, w) > 200:
                        continue
                    ours = smart_resize(h, w, factor=factor, min_pixels=least, max_pixels=most)
                    assert ours == theirs(h, w, factor=factor, min_pixels=least, max_pixels=most), (
                        h,
                        w,
                        factor,
                    )
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, factor=28, min_pixels=3136, max_pixels=12845056)
