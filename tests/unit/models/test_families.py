"""Every built-in model family trains, exports and generates; LoRA meanings, FSDP wrap class and chat templates
per family.

The tiny models are each family's own transformers class with random init (`zerofit.models.tiny`). Training runs
in this process on the single engine (seconds each); the 2-rank ZeRO-2 and FSDP2 launches are in
tests/distributed/test_families_engines.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import zerofit
from zerofit.catalogue.models import CATALOGUE, TINY_CONFIGS
from zerofit.cli import main as cli
from zerofit.core.errors import ConfigError
from zerofit.engine_spec.render import decoder_layer_class
from zerofit.levers.layers import decoder_layers
from zerofit.levers.recompute import enable_activation_checkpointing
from zerofit.models.lora import adapted_counts, apply_lora, lora_config
from zerofit.models.lora_targets import resolve_lora_targets
from zerofit.models.meta import build_meta_model

REPO = Path(__file__).resolve().parents[3]
FAMILIES = tuple(TINY_CONFIGS)
MOE = ("tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe")

# Adapted modules of the 2-layer tiny model per meaning: attention / mlp / all-linear (None: refused).
# Phi-3's fused qkv_proj and gate_up_proj are one module each; Mixtral's and Qwen3-MoE's MLPs are all
# experts (3-D parameters, not modules); Qwen2-MoE's shared expert is 3 linears per layer.
EXPECTED_MODULES: dict[str, tuple[int, int | None, int]] = {
    **{name: (8, 6, 14) for name in FAMILIES},
    "tiny-phi3": (4, 4, 8),
    "tiny-mixtral": (8, None, 8),
    "tiny-qwen3-moe": (8, None, 8),
}


def _adapted(name: str, target: str, moe_experts: str = "shared", train_router: bool = False) -> Any:
    model = build_meta_model(name, attn_implementation="eager")
    return adapted_counts(apply_lora(model, lora_config(4, 8, 0.0, target, False, moe_experts, train_router)))


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_meanings_adapt_each_family_s_own_modules(name: str) -> None:
    """attention / mlp / all-linear reach the family's projections (fused included) on a meta build; a
    meaning that reaches nothing (mlp of an all-experts model, experts frozen) is refused with the fix."""
    for target, expected in zip(("attention", "mlp", "all-linear"), EXPECTED_MODULES[name], strict=True):
        if expected is None:
            with pytest.raises(ConfigError, match=r"adapts nothing.*lora.moe_experts=all"):
                _adapted(name, target)
            continue
        counts = _adapted(name, target)
        assert (counts.modules, counts.parameters, counts.full) == (expected, 0, 0), target
        assert counts.trainable_params > 0


@pytest.mark.parametrize("name", MOE)
def test_moe_experts_and_router_choices(name: str) -> None:
    """moe_experts=all adapts both fused expert weights of each layer through peft's target_parameters;
    train_router trains the router in full; the plan's words say so."""
    base = _adapted(name, "all-linear")
    counts = _adapted(name, "all-linear", "all", True)
    routers = 4 if name == "tiny-qwen2-moe" else 2  # Qwen2-MoE: the router and the shared-expert gate
    assert (counts.modules, counts.parameters, counts.full) == (base.modules, 4, routers)
    assert counts.trainable_params > base.trainable_params
    summary = resolve_lora_targets(CATALOGUE[name], "all-linear", "all", True).summary
    assert "every routed expert" in summary and "router trained in full" in summary


def test_moe_expert_and_router_adapters_merge_into_the_base_exactly() -> None:
    """What `zerofit export --merge` does (peft's merge_and_unload) keeps the adapted MoE model's logits:
    the routed experts' parameter adapters and the fully trained router fold into plain weights."""
    from transformers import AutoModelForCausalLM

    from zerofit.models.tiny import ensure_tiny_model

    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model("tiny-qwen2-moe", 0), dtype=torch.float32)
    model = apply_lora(base, lora_config(4, 8, 0.0, "all-linear", False, "all", True), seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:  # as if trained: every adapter and the router moved
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
        ids = torch.randint(4, 100, (1, 16), generator=gen)
        adapted = model(ids).logits
        merged = model.merge_and_unload()
        assert not any("lora" in name or "modules_to_save" in name for name, _ in merged.named_parameters())
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=0, atol=1e-5)


def test_the_plan_says_what_lora_adapted() -> None:
    """`zerofit plan`'s `lora` block (text and --json) for an MoE model: the mapped names and the counts."""
    from zerofit.config import load_config
    from zerofit.planner.lora_report import lora_targets_report

    overrides = ["model.name_or_path=tiny-mixtral", "lora.target_modules=attention", "lora.moe_experts=all"]
    report = lora_targets_report(load_config(REPO / "configs" / "demo.yaml", overrides))
    assert report is not None and report["family"] == "Mixtral"
    assert report["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert (report["adapted_modules"], report["adapted_parameters"], report["full_modules"]) == (8, 4, 0)
    assert report["trainable_params"] > 0 and "8 modules + 4 expert parameters adapted" in report["described"]


def test_moe_keys_on_a_dense_model_and_unknown_meanings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"lora.moe_experts = 'all' for Qwen3 \(dense\)"):
        resolve_lora_targets(CATALOGUE["tiny-qwen3"], "all-linear", "all")
    with pytest.raises(ConfigError, match=r"lora.train_router = true for Phi-3"):
        resolve_lora_targets(CATALOGUE["tiny-phi3"], "all-linear", train_router=True)
    with pytest.raises(ConfigError, match=r"model_type 'gpt2'.*lora.target_modules=all-linear"):
        resolve_lora_targets({"model_type": "gpt2"}, "attention")
    assert resolve_lora_targets({"model_type": "gpt2"}, "all-linear").target_modules == "all-linear"


@pytest.mark.parametrize("name", FAMILIES)
def test_fsdp_wrap_class_and_checkpointed_layers_come_from_the_model(name: str) -> None:
    """The class render names for FSDP is the model class's own `_no_split_modules` entry, and it is the
    class of every decoder layer the checkpointing walks."""
    model = build_meta_model(name, attn_implementation="eager")
    layer_class = decoder_layer_class(CATALOGUE[name])
    assert layer_class in type(model)._no_split_modules
    assert [type(layer).__name__ for layer in decoder_layers(model)] == [layer_class] * 2


def test_a_model_without_decoder_layers_is_refused_naming_its_classes() -> None:
    class Blocks(torch.nn.Module):
        _no_split_modules: ClassVar[list[str]] = ["MyBlock"]

    with pytest.raises(ConfigError, match=r"no decoder layer.*_no_split_modules: MyBlock"):
        enable_activation_checkpointing(Blocks(), 1)
    with pytest.raises(ConfigError, match=r"decoder layer of model_type 'bert'"):
        decoder_layer_class({"model_type": "bert", "architectures": ["BertModel"]})


CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "add: 2+2"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "copy: ab"},
    {"role": "assistant", "content": "ab"},
]
# What each family's template puts around an assistant turn: the labelled text is the answer and the turn end.
TURN_END = {
    "tiny-llama": "</s>",
    "tiny-llama3": "<|eot_id|>",
    "tiny-mistral": "</s>",
    "tiny-mixtral": "</s>",
    "tiny-phi3": "<|end|>",
    "tiny-gemma2": "<end_of_turn>",
    "tiny-gemma3": "<end_of_turn>",
}


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_template_labels_only_the_assistant_turns(name: str) -> None:
    """Through the data pipeline's conversation tokenizer: each family's own template text (generation marks
    or the turn-by-turn path) labels exactly the assistant answers and their turn-end token."""
    from zerofit.data.chat import tokenize_conversation
    from zerofit.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(name)
    ids, mask, truncated = tokenize_conversation(tokenizer, CONVERSATION, 512, "test")
    end = TURN_END.get(name, "<|im_end|>")
    learned = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert not truncated and learned.replace("\n", "") == f"4{end}ab{end}"
    assert tokenizer.eos_token == end
    rendered = tokenizer.decode(ids)
    marker = {"<|im_end|>": "<|im_start|>user", "<end_of_turn>": "<start_of_turn>user", "<|end|>": "<|user|>"}
    assert marker.get(end, "") in rendered  # the family's real turn markers, not tiny-llama's letters


def _attention(name: str) -> str:
    """Gemma-2's soft-capped attention runs eager only (sdpa is refused before the load, tested below)."""
    return "eager" if name == "tiny-gemma2" else "sdpa"


def test_sdpa_for_a_model_class_without_it_is_refused_before_the_load() -> None:
    from zerofit.models.build import check_attention_before_load

    with pytest.raises(ConfigError, match=r"Gemma2ForCausalLM does not run.*model.attn_implementation=eager"):
        check_attention_before_load("tiny-gemma2", "sdpa")
    check_attention_before_load("tiny-gemma2", "eager")
    check_attention_before_load("tiny-gemma3", "sdpa")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family: 2 LoRA steps (all-linear; the MoE models with every expert and the router) on chat
    data, one process, then `zerofit export --merge`."""
    out = tmp_path_factory.mktemp("families")
    runs: dict[str, Path] = {}
    for name in FAMILIES:
        moe = {"moe_experts": "all", "train_router": True} if name in MOE else {}
        zerofit.train(
            str(REPO / "configs" / "demo.yaml"),
            output_dir=str(out),
            run_name=name,
            model={"name_or_path": name, "attn_implementation": _attention(name)},
            distributed={"strategy": "single", "preset": None},
            batch={"global_batch_size": 4, "micro_batch_size": 2},
            train={"max_steps": 2, "precision": "fp32"},
            lora={"target_modules": "all-linear", **moe},
            # 160: the real Qwen2.5 / Llama 3.1 templates (tiny-qwen2, tiny-llama3) open with ~80 tokens of system turn
            data={"path": str(REPO / "data" / "demo_chat.jsonl"), "max_seq_len": 160},
            logging={"console": False, "wandb": {"mode": "disabled"}},
        )
        runs[name] = out / name
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_trains_exports_merged_and_generates(
    trained: dict[str, Path], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerofit.api import read_result

    result = read_result(trained[name])
    assert result.steps == 2 and result.final_loss is not None and result.final_loss == result.final_loss
    merged = trained[name].parent / f"{name}-merged"
    assert cli(["export", str(trained[name]), "--merge", "--out", str(merged)]) == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    capsys.readouterr()
    assert cli(["generate", str(merged), "--prompt", "add: 2+2\n", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    # A random model may end at once (eos first): generate says so rather than printing nothing silently.
    assert out.strip() or "the continuation is empty" in err


@pytest.mark.slow
def test_gguf_export_refuses_a_family_it_does_not_map(
    trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gguf"
    assert cli(["export", str(trained["tiny-gemma3"]), "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the model is a 'gemma3_text'" in err and "convert_hf_to_gguf.py" in err and "Traceback" not in err
    assert not out.exists()


# The held-out-style families and the MoE recipe's tiny twin: each also trains QLoRA on one process.
HELD_OUT = ("tiny-qwen3", "tiny-gemma3", "tiny-phi3", "tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe")


@pytest.mark.slow
@pytest.mark.parametrize("name", HELD_OUT)
def test_qlora_trains_exports_merged_and_generates(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4-bit base (bitsandbytes on CPU) under LoRA all-linear on one process (the MoE models with every
    expert's 3-D weights adapted as they are and the router trained, kept out of quantization), then
    `zerofit export --merge` (the base dequantized, bf16) and `zerofit generate` from the merged model."""
    moe = {"moe_experts": "all", "train_router": True} if name in MOE else {}
    result = zerofit.train(
        str(REPO / "configs" / "demo.yaml"),
        output_dir=str(tmp_path),
        run_name=name,
        model={"name_or_path": name},
        distributed={"strategy": "single", "preset": None},
        batch={"global_batch_size": 2, "micro_batch_size": 2},
        train={"max_steps": 2, "precision": "bf16"},
        quantization={"load_in": "4bit"},
        lora={"target_modules": "all-linear", **moe},
        logging={"console": False, "wandb": {"mode": "disabled"}},
    )
    assert result.steps == 2 and result.final_loss is not None and result.final_loss == result.final_loss
    from zerofit.config import load_config

    assert load_config(tmp_path / name / "config.yaml").quantization.load_in == "4bit"
    merged = tmp_path / "merged"
    assert cli(["export", str(tmp_path / name), "--merge", "--out", str(merged)]) == 0
    info = json.loads((merged / "zerofit_export.json").read_text())
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    assert (info["kind"], info["dtype"]) == ("merged", "bfloat16")
    capsys.readouterr()
    assert cli(["generate", str(merged), "--prompt", "add: 2+2", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert (out.strip() or "the continuation is empty" in err) and "Traceback" not in err


def test_a_trained_router_is_kept_out_of_quantization() -> None:
    """QLoRA with `lora.train_router`: the router (Qwen2-MoE's gate and shared-expert gate, nn.Linears) stays a
    float module peft can train in full; bitsandbytes would otherwise quantize it to uint8 storage."""
    from zerofit.config import load_config
    from zerofit.models.build import quantization_config

    overrides = ["model.name_or_path=tiny-qwen2-moe", "quantization.load_in=4bit", "lora.moe_experts=all"]
    trained = quantization_config(load_config(None, [*overrides, "lora.train_router=true"]))
    assert {"lm_head", "mlp.gate", "mlp.shared_expert_gate"} <= set(trained.llm_int8_skip_modules)
    assert quantization_config(load_config(None, overrides)).llm_int8_skip_modules is None


@pytest.mark.parametrize(
    ("name", "moe"), [("tiny-llama", False), ("tiny-qwen3", False), ("tiny-mixtral", True)]
)
def test_an_empty_target_list_says_it_names_no_module(name: str, moe: bool) -> None:
    """`lora.target_modules=[]` adapts nothing: the refusal says so and lists the accepted values, not a
    mixture-of-experts story on a dense model; on an MoE model the routed experts are the way out."""
    with pytest.raises(ConfigError) as err:
        resolve_lora_targets(TINY_CONFIGS[name], [])
    (problem,) = err.value.problems
    assert problem.startswith("lora.target_modules = []: an empty list names no module")
    assert "attention, mlp, all-linear" in problem and "lora.target_modules=[q_proj,v_proj]" in problem
    assert ("mixture" not in problem) and (("lora.moe_experts=all" in problem) == moe)
    assert resolve_lora_targets(TINY_CONFIGS["tiny-mixtral"], [], moe_experts="all").target_parameters
