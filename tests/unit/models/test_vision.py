"""Vision-language models in one process: what LoRA trains of each built-in family (the language
model; the projector and vision tower only when asked), and the loss exact whatever the split on ragged image +
text data (images of different sizes, some rows without images): one global batch as 8 x 1, 2 x 4 and 1 x 8."""

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
from zerofit.token_loss.sums import IGNORE_INDEX, batch_labels, count_label_tokens, token_sum_loss

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "data" / "demo-vlm.jsonl"


# Each built-in family: (name, what its language model's, vision tower's and projector's module names hold).
FAMILIES = [
    ("tiny-qwen2-vl", "language_model", "visual.blocks", "visual.merger"),
    ("tiny-gemma3-vl", "language_model", "vision_tower", "multi_modal_projector"),
    ("tiny-smolvlm", "text_model", "vision_model", "connector"),
]
NAMES = [family[0] for family in FAMILIES]


def _cfg(name: str = "tiny-qwen2-vl", **lora: Any) -> Any:
    return config(
        {"model": {"name_or_path": name}, "distributed": {"strategy": "single"}},
        train={"precision": "fp32", "activation_checkpointing": False},
        lora={"r": 4, "alpha": 8, "dropout": 0.0, **lora},
    )


def _trainable(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "language", "tower", "projector"), FAMILIES)
def test_lora_trains_the_language_model_and_leaves_vision_and_projector_frozen(
    name: str, language: str, tower: str, projector: str
) -> None:
    built = build_model(_cfg(name))
    names = _trainable(built.model)
    assert names and all(language in n and "lora_" in n for n in names)
    assert "language model" in (built.adapters or "")
    full = _trainable(build_model(_cfg(name, projector="full")).model)
    assert any(projector in n and "lora_" not in n for n in full)
    adapted = _trainable(build_model(_cfg(name, vision_tower=True)).model)
    assert any(tower in n and "lora_" in n for n in adapted)
    assert not any(projector in n for n in adapted)


def _examples(cfg: Any) -> list[Any]:
    processor = load_vision_processor(resolve_model_path(cfg), load_tokenizer(cfg))
    examples = load_vision_examples(DEMO, processor, 256).examples
    return [examples[i] for i in (0, 6, 1, 2, 7, 3, 4, 5)]  # images of 5 sizes and 2 text-only rows, mixed


def _curve(cfg: Any, examples: list[Any], micro: int, steps: int = 2) -> list[float]:
    built = build_model(cfg)
    strategy = one_process_strategy()
    strategy.prepare(
        built.model,
        lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    batches = [collate(examples[k : k + micro], pad_id=0) for k in range(0, len(examples), micro)]
    return [train_step(strategy, built.model, batches, max_grad_norm=None).loss for _ in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_loss_curve_is_the_same_for_8x1_and_2x4_on_ragged_image_text_data(name: str) -> None:
    cfg = _cfg(name, projector="full")  # the projector's gradient comes from the images: it must be exact too
    examples = _examples(cfg)
    whole = _curve(cfg, examples, 8)
    assert _curve(cfg, examples, 2) == pytest.approx(whole, abs=2e-5)
    assert _curve(cfg, examples, 1) == pytest.approx(whole, abs=2e-5)  # text-only micro-batches too
    assert whole[1] < whole[0]  # it learns


def test_per_micro_batch_means_would_disagree_with_the_global_token_mean() -> None:
    """What the exact split guards against: averaging each micro-batch's own token mean weighs a row by its
    micro-batch, not its tokens; on this data the two differ well beyond the 2e-5 above."""
    cfg = _cfg()
    examples = _examples(cfg)
    model = build_model(cfg).model.eval()
    sums, counts = [], []
    with torch.no_grad():
        for k in range(0, 8, 2):
            batch = collate(examples[k : k + 2], pad_id=0)
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            labels, _ = batch_labels(batch)
            sums.append(float(token_sum_loss(model(**inputs, use_cache=False).logits, labels)))
            counts.append(count_label_tokens(labels))
    global_mean = sum(sums) / sum(counts)
    per_micro = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
    assert len(set(counts)) > 1 and abs(per_micro - global_mean) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_demo_trains_exports_merged_with_its_processor_and_generates_from_an_image(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    import zerofit
    from zerofit.cli import main as cli

    result = zerofit.train(
        str(REPO / "configs" / "demo-vlm.yaml"),
        output_dir=str(tmp_path),
        run_name="vlm",
        model={"name_or_path": name},
        train={"max_steps": 2},
        logging={"console": False, "wandb": {"mode": "disabled"}},
    )
    assert result.steps == 2 and result.final_loss == result.final_loss
    merged = tmp_path / "merged"
    assert cli(["export", str(tmp_path / "vlm"), "--merge", "--out", str(merged)]) == 0
    assert (merged / "preprocessor_config.json").is_file() and (merged / "model.safetensors").is_file()
    assert "AutoModelForImageTextToText" in capsys.readouterr().out
    image = str(REPO / "data" / "demo-vlm" / "red.png")
    for source in (merged, tmp_path / "vlm"):
        args = ["generate", str(source), "--image", image, "--prompt", "Colour?", "--max-new-tokens", "3"]
        assert cli(args) == 0
        out, err = capsys.readouterr()
        assert (out.strip() or "the continuation is empty" in err) and "Traceback" not in err
    assert cli(["generate", str(merged), "--image", str(tmp_path / "gone.png"), "--prompt", "Colour?"]) == 2
    err = capsys.readouterr().err
    assert "--image" in err and "gone.png" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_text_only_forward_runs_the_vision_tower_and_changes_nothing() -> None:
    """Sharded engines need every rank to run the vision blocks (`run_vision_every_step`): a micro-batch
    without images runs them on a zero image whose features are added times 0.0, so the logits are those of
    the model without the hook and the projector's gradient is zero."""
    cfg = _cfg(projector="full")
    model = build_model(cfg).model  # the hook is installed
    plain = build_model(cfg).model
    plain.base_model.model.model._forward_pre_hooks.clear()  # the same model without the hook
    text_only = collate([_examples(cfg)[1]], pad_id=0)  # a row without images
    assert "pixel_values" not in text_only
    inputs = {k: v for k, v in text_only.items() if k != "labels"}
    calls: list[int] = []
    block = model.base_model.model.model.visual.blocks[0]
    block.register_forward_hook(lambda *a: calls.append(1))
    logits = model(**inputs, use_cache=False).logits
    assert calls == [1] and torch.equal(logits, plain(**inputs, use_cache=False).logits)
    logits.sum().backward()
    merger = [p.grad for n, p in model.named_parameters() if "merger" in n and p.requires_grad]
    assert merger and all(g is not None and float(g.abs().max()) == 0.0 for g in merger)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "tower", "blocks"),
    [
        ("tiny-qwen2-vl", "visual", {"Qwen2VLVisionBlock", "Qwen2VLDecoderLayer"}),
        ("tiny-gemma3-vl", "vision_tower", {"SiglipEncoderLayer", "Gemma3DecoderLayer"}),
        ("tiny-smolvlm", "vision_model", {"SmolVLMEncoderLayer", "LlamaDecoderLayer"}),
    ],
)
def test_qlora_quantizes_the_language_model_and_keeps_the_vision_tower_float(
    name: str, tower: str, blocks: set[str]
) -> None:
    """QLoRA on a vision-language model: the language model's linears in 4-bit, the vision tower and the
    projector left in float (bitsandbytes on CPU), with activation checkpointing of vision and language
    blocks; one step trains."""
    cfg = config(
        {"model": {"name_or_path": name}, "distributed": {"strategy": "single"}},
        train={"precision": "bf16", "activation_checkpointing": True},
        quantization={"load_in": "4bit"},
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
    )
    model = build_model(cfg).model
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    language = dict((f[0], f[1]) for f in FAMILIES)[name]
    assert any(language in n and k == "Linear4bit" for n, k in kinds.items())
    assert not any(tower in n and k == "Linear4bit" for n, k in kinds.items())
    checkpointed = {type(m).__name__ for m in model.modules() if getattr(m, "gradient_checkpointing", False)}
    assert blocks <= checkpointed
    batch = collate(_examples(cfg)[:2], pad_id=0)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels, _ = batch_labels(batch)
    token_sum_loss(model(**inputs, use_cache=False).logits, labels).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*NAMES, "tiny-llava", "tiny-mllama"])
def test_each_tiny_family_trains_lora_on_ragged_image_text_data(name: str) -> None:
    """Every built-in vision-language family: its processor's image tokens (never labelled: the loss counts
    the assistant text only, not an image token nor a marker around one), LoRA on its language model only,
    and two steps on one process that lower the loss."""
    cfg = config(
        {"model": {"name_or_path": name}, "distributed": {"strategy": "single"}},
        train={"precision": "fp32"},
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
    )
    processor = load_vision_processor(resolve_model_path(cfg), load_tokenizer(cfg))
    examples = load_vision_examples(DEMO, processor, 256).examples
    image_tokens = [sum(t == processor.image_token_id for t in e.input_ids) for e in examples]
    assert image_tokens.count(0) == 4 and all(n > 0 for n in image_tokens[:6])
    assert all(lab != processor.image_token_id for e in examples for lab in e.labels)
    eos = processor.tokenizer.eos_token
    for example in examples:
        learned = processor.tokenizer.decode([lab for lab in example.labels if lab != IGNORE_INDEX])
        assert learned.lstrip().startswith("It is ") and learned.endswith(eos) and learned.count(eos) == 1
        labels, _ = batch_labels(collate([example], pad_id=0))
        assert count_label_tokens(labels) == len(
            processor.tokenizer.encode(learned, add_special_tokens=False)
        )
    built = build_model(cfg)
    language = dict((f[0], f[1]) for f in FAMILIES).get(name, "language_model")
    assert all(language in n for n in _trainable(built.model))
    curve = _curve(cfg, examples[:8], 4)
    assert curve[1] < curve[0]


@pytest.mark.slow
def test_the_plan_says_what_lora_adapts_and_plans_the_data_images(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from zerofit.cli import main as cli

    assert cli(["plan", "--config", str(REPO / "configs" / "demo-vlm.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["lora"]["described"].startswith("LoRA on the language model's Qwen2: all-linear")
    assert "error" not in plan["memory"]  # the planner models the tower and the images (planner.images)
    assert "from the data (" in plan["memory"]["image_tokens"]["source"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gemma3-vl", "tiny-smolvlm", "tiny-mllama", "tiny-llava"])
def test_every_family_is_planned(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """The planner's shape-only build of each family: Gemma 3's per-layer attention types cut with its
    language model's layers, Mllama's padding id within its vocabulary (both once failed with a traceback)."""
    import json

    from zerofit.cli import main as cli

    extra = ["data.max_image_tokens=null"] if name == "tiny-mllama" else []
    args = ["plan", "--config", str(REPO / "configs" / "demo-vlm.yaml"), f"model.name_or_path={name}", *extra]
    assert cli([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "error" not in plan["memory"] and plan["memory"]["total_gib"] > 0
