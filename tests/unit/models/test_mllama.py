"""Llama 3.2 Vision in one process (`zerofit.models.mllama`): tiny-mllama's LoRA targets (self- and
cross-attention of the language model; the projector and vision tower only when asked), a row without images
the same beside image rows as alone (its padding image), the loss exact for 8 x 1 and 2 x 4 on ragged
image + text data, QLoRA with the tower in float and every block checkpointed, and export + generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from config_helpers import config, one_process_strategy
from zerofit.data import collate
from zerofit.data.vision import load_vision_examples
from zerofit.loop.train import train_step
from zerofit.models.build import build_model, load_tokenizer, resolve_model_path
from zerofit.models.vision import load_vision_processor
from zerofit.token_loss.sums import batch_labels, token_sum_loss

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "data" / "demo-vlm.jsonl"
BASE = {"model": {"name_or_path": "tiny-mllama"}, "distributed": {"strategy": "single"}}


def _cfg(**lora: Any) -> Any:
    return config(
        BASE,
        train={"precision": "fp32", "activation_checkpointing": False},
        lora={"r": 4, "alpha": 8, "dropout": 0.0, **lora},
    )


def _trainable(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _examples(cfg: Any) -> list[Any]:
    processor = load_vision_processor(resolve_model_path(cfg), load_tokenizer(cfg))
    examples = load_vision_examples(DEMO, processor, 256).examples
    # Images of 1 and 2 tiles and 3 text-only rows: as 2 x 4, a micro-batch with and one without images.
    return [examples[i] for i in (0, 6, 7, 8, 1, 2, 3, 4)]


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


@pytest.mark.slow
def test_lora_adapts_self_and_cross_attention_and_leaves_vision_and_projector_frozen() -> None:
    names = _trainable(build_model(_cfg()).model)
    assert names and all("language_model" in n and "lora_" in n for n in names)
    assert any(".cross_attn.q_proj.lora_" in n for n in names) and any(
        ".self_attn.q_proj." in n for n in names
    )
    full = _trainable(build_model(_cfg(projector="full")).model)
    assert any("multi_modal_projector" in n and "lora_" not in n for n in full)
    tower = _trainable(build_model(_cfg(vision_tower=True)).model)
    assert any("vision_model.transformer.layers" in n and "lora_" in n for n in tower)
    assert any("vision_model.global_transformer.layers" in n and "lora_" in n for n in tower)
    assert not any("multi_modal_projector" in n for n in tower)


@pytest.mark.slow
def test_a_row_without_images_is_the_same_alone_as_beside_an_image_row() -> None:
    """A text token that sees no image attends evenly over its row's vision states (transformers' Mllama), so
    a text-only row must hold the same padding image alone as beside image rows; without zerofit's padding
    image transformers skips the cross-attention layers for it alone (another output: the gates are open)."""
    cfg = _cfg(projector="full")
    examples = _examples(cfg)
    model = build_model(cfg).model.eval()
    text_only, image_row = examples[1], examples[0]
    alone = collate([text_only], pad_id=0)
    beside = collate([text_only, image_row], pad_id=0)
    n = len(text_only.input_ids)
    cross = model.base_model.model.model.language_model.layers[1]
    calls: list[int] = []
    cross.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        solo = model(**_inputs(alone), use_cache=False).logits[0, :n]
        assert calls == [1]  # the cross-attention layer ran without any image in the batch
        pair = model(**_inputs(beside), use_cache=False).logits[0, :n]
        assert torch.allclose(solo, pair, atol=1e-5)
        model.base_model.model.model._forward_pre_hooks.clear()  # transformers alone: the layer is skipped
        skipped = model(**_inputs(alone), use_cache=False).logits[0, :n]
    assert float((skipped - pair).abs().max()) > 1e-3


@pytest.mark.slow
def test_the_loss_curve_is_the_same_for_8x1_and_2x4_on_ragged_image_text_data() -> None:
    cfg = _cfg(projector="full")  # the projector's gradient comes from the images: it must be exact too
    examples = _examples(cfg)

    def curve(micro: int) -> list[float]:
        built = build_model(cfg)
        strategy = one_process_strategy()
        strategy.prepare(
            built.model,
            lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5),
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        )
        batches = [collate(examples[k : k + micro], pad_id=0) for k in range(0, 8, micro)]
        return [train_step(strategy, built.model, batches, max_grad_norm=None).loss for _ in range(2)]

    whole = curve(8)
    assert curve(2) == pytest.approx(whole, abs=2e-5)
    assert whole[1] < whole[0]  # it learns


@pytest.mark.slow
def test_qlora_keeps_the_tower_float_and_checkpoints_vision_and_language_blocks() -> None:
    cfg = config(
        BASE,
        train={"precision": "bf16", "activation_checkpointing": True},
        quantization={"load_in": "4bit"},
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
    )
    model = build_model(cfg).model
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert any("language_model" in n and k == "Linear4bit" for n, k in kinds.items())
    assert not any(("vision_model" in n or "projector" in n) and k == "Linear4bit" for n, k in kinds.items())
    checkpointed = {type(m).__name__ for m in model.modules() if getattr(m, "gradient_checkpointing", False)}
    assert {
        "MllamaVisionEncoderLayer",
        "MllamaSelfAttentionDecoderLayer",
        "MllamaCrossAttentionDecoderLayer",
    } <= checkpointed
    batch = collate(_examples(cfg)[:2], pad_id=0)
    labels, _ = batch_labels(batch)
    token_sum_loss(model(**_inputs(batch), use_cache=False).logits, labels).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.slow
def test_it_trains_exports_merged_with_its_processor_and_generates_from_an_image(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import zerofit
    from zerofit.cli import main as cli

    result = zerofit.train(
        str(REPO / "configs" / "demo-vlm.yaml"),
        output_dir=str(tmp_path),
        run_name="mllama",
        model={"name_or_path": "tiny-mllama"},
        data={"max_image_tokens": None},  # the demo's Qwen2-VL limit: nothing to lower for Mllama
        train={"max_steps": 2},
        logging={"console": False, "wandb": {"mode": "disabled"}},
    )
    assert result.steps == 2 and result.final_loss == result.final_loss
    merged = tmp_path / "merged"
    assert cli(["export", str(tmp_path / "mllama"), "--merge", "--out", str(merged)]) == 0
    assert (merged / "preprocessor_config.json").is_file() and (merged / "model.safetensors").is_file()
    capsys.readouterr()
    image = str(REPO / "data" / "demo-vlm" / "red.png")
    args = ["generate", str(merged), "--image", image, "--prompt", "Colour?", "--max-new-tokens", "3"]
    assert cli(args) == 0
    out, err = capsys.readouterr()
    assert (out.strip() or "the continuation is empty" in err) and "Traceback" not in err
