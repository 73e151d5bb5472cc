"""The planner per model family: the analytic estimate against the tensor-level trace, family by
family, at real shapes (the catalogue's config.json values) and at tiny shapes of the same classes.

The real shapes are the acceptance set: Qwen3-8B (q/k norms), Gemma-3-12B (4 norms, q/k norms, head_dim 256,
sliding-window layers, a tied 262k embedding), Mistral-7B, Phi-4 (fused qkv / gate_up projections) and
Mixtral-8x7B (8 experts, top-2, routed experts frozen: `lora.moe_experts: shared`), at micro
1 x 2048 with LoRA on all linear layers. Each point traces 1 and 2 decoder layers in FakeTensorMode (2-14 s).
"""

from __future__ import annotations

import dataclasses

import pytest

from zerofit.catalogue import models as catalogue
from zerofit.core.errors import ConfigError
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario
from zerofit.planner.shapes import lora_shape, model_shape
from zerofit.planner.speed import flops_per_token
from zerofit.planner.trace import trace_memory

REAL = [
    "Qwen/Qwen3-8B",
    "google/gemma-3-12b-pt",
    "mistralai/Mistral-7B-v0.3",
    "microsoft/phi-4",
    "mistralai/Mixtral-8x7B-v0.1",
]


@pytest.mark.slow
@pytest.mark.parametrize("model", REAL)
def test_real_shapes_within_5_percent_of_trace(model: str) -> None:
    scn = Scenario(model=model, seq_len=2048, micro_batch_size=1, lora=True)
    traced = trace_memory(scn).tensors_gib
    predicted = estimate(scn).tensors_gib
    assert abs(predicted / traced - 1) < 0.05, (model, predicted, traced)


# A tiny member of each family: the catalogue entry shrunk (head_dim kept != hidden / heads where the family
# sets it, GQA or full multi-head attention as the family has it, windows shorter than the sequence, 8
# experts of which 2 are routed).
_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _tiny(model: str) -> str:
    real = catalogue.model_config_dict(model)
    cfg = {**real, **_TINY}
    if real["num_key_value_heads"] == real["num_attention_heads"]:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]  # the family's full multi-head attention
    for key, value in {
        "head_dim": 32,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
    }.items():
        if key in cfg:
            cfg[key] = value
    for key in ("num_experts", "num_local_experts"):
        if key in cfg:
            cfg[key], cfg["num_experts_per_tok"] = 8, 2
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 64
    name = f"tiny-test/{model}"
    catalogue.CATALOGUE[name] = cfg
    return name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "moe_experts", "train_router"),
    [
        ("google/gemma-2-9b", "shared", False),
        ("Qwen/Qwen3-30B-A3B", "all", False),
        ("Qwen/Qwen1.5-MoE-A2.7B", "shared", True),
        ("mistralai/Mixtral-8x7B-v0.1", "shared", False),
    ],
)
def test_tiny_shapes_within_5_percent_of_trace(model: str, moe_experts: str, train_router: bool) -> None:
    # A padded micro-batch of 2 x 256: masked attention, sliding windows of 64, routed rows of 2 experts;
    # every routed expert adapted (merged weights saved per layer) and a router trained in full. (The other
    # families at tiny shapes: benchmarks/planner_families.py, all within 5.3%.)
    name = _tiny(model)
    attn = "eager" if model_shape(name).attn_logit_softcapping else "sdpa"  # Gemma 2: eager only
    scn = Scenario(
        model=name,
        seq_len=256,
        micro_batch_size=2,
        lora=True,
        attn_implementation=attn,
        lora_moe_experts=moe_experts,
        lora_train_router=train_router,
    )
    traced = trace_memory(scn).tensors_gib
    assert abs(estimate(scn).tensors_gib / traced - 1) < 0.05, model


def test_family_shapes_come_from_the_model_classes() -> None:
    gemma = model_shape("google/gemma-3-12b-pt")
    assert gemma.tie_word_embeddings and gemma.lm_head_params == 0  # one 262k x 3840 weight
    assert gemma.head_dim == 256 and gemma.q_dim == 4096 != gemma.hidden_size
    # 4 norms of the hidden size and q/k norms over each head (one rstd per head).
    assert sorted(w for _, w, rows in gemma.norms if rows == 1) == [3840] * 4
    assert sorted(w for _, w, rows in gemma.norms if rows > 1) == [2048, 4096]
    assert (gemma.sliding_window, gemma.sliding_layers) == (1024, 40)  # five local layers to one global
    mixtral = model_shape("mistralai/Mixtral-8x7B-v0.1")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 14336)
    assert mixtral.layer_expert_params == 8 * 3 * 4096 * 14336  # every expert resident
    assert model_shape("Qwen/Qwen1.5-MoE-A2.7B").shared_expert_intermediate_size == 5632


def test_moe_choices_reach_what_peft_adapts() -> None:
    # lora.moe_experts: `shared` (default) leaves the routed experts' fused 3-D weights frozen; `all` adapts
    # them through peft's target_parameters (each layer then rebuilds W + BA); lora.train_router trains the
    # router in full (modules_to_save), which then saves its input.
    model = "mistralai/Mixtral-8x7B-v0.1"
    default = lora_shape(model, 16)
    assert not default.experts_adapted and not default.router_adapted
    every = lora_shape(model, 16, moe_experts="all")
    assert every.merged_expert_numel == model_shape(model).layer_expert_params
    assert every.trainable_params > 10 * default.trainable_params  # a LoRA pair per expert weight
    assert lora_shape(model, 16, train_router=True).router_adapted
    qwen15 = lora_shape("Qwen/Qwen1.5-MoE-A2.7B", 16)
    assert any("shared_expert" in t.name for t in qwen15.layer_targets)  # `shared`: its shared expert adapts


def test_moe_speed_counts_the_routed_experts_only() -> None:
    scn = Scenario(model="mistralai/Mixtral-8x7B-v0.1", seq_len=2048, micro_batch_size=1)
    shape = model_shape(scn.model)
    total, _ = flops_per_token(scn)
    # 2 of 8 experts per token: 12.6B active of 46.7B; forward + backward ~ 4-6 x active, far below 4 x 47B.
    active = shape.layer_active_matmul_params * shape.num_layers
    assert active < 0.3 * shape.total_params
    assert 4 * active < total < 4 * shape.total_params


def test_softcapped_attention_refuses_sdpa_with_the_field() -> None:
    with pytest.raises(
        ConfigError, match=r"model.attn_implementation = 'sdpa'.*set model.attn_implementation=eager"
    ):
        trace_memory(Scenario(model="google/gemma-2-9b", seq_len=128, micro_batch_size=1))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_expert_adapter_flops_are_what_peft_computes(name: str, checkpointed: bool) -> None:
    """`lora.moe_experts=all` costs, over the same step with the experts frozen, exactly the FLOPs torch's
    FlopCounterMode counts in a real forward + backward: the merged weight's gradient over the routed tokens
    and peft's per-forward folds of W + s BA (twice each: register_parametrization evaluates it once),
    again in a recomputed layer. Transformers' eager experts (its grouped_mm has no FLOP formula)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from zerofit.levers.recompute import enable_activation_checkpointing
    from zerofit.models.lora import apply_lora, lora_config
    from zerofit.models.tiny import ensure_tiny_model
    from zerofit.planner.speed import expert_adapter_flops

    seq = 64
    ids = torch.randint(4, 100, (1, seq), generator=torch.Generator().manual_seed(0))

    def step_flops(moe_experts: str) -> int:
        base = AutoModelForCausalLM.from_pretrained(
            ensure_tiny_model(name, 0), dtype=torch.float32, experts_implementation="eager"
        )
        model = apply_lora(
            base, lora_config(4, 8, 0.0, "attention", False, moe_experts, False), seed=0
        ).train()
        enable_activation_checkpointing(model.get_base_model(), 2 if checkpointed else 0)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        return int(counter.get_total_flops())

    scn = Scenario(
        model=name,
        seq_len=seq,
        micro_batch_size=1,
        lora=True,
        lora_r=4,
        lora_targets="attention",
        lora_moe_experts="all",
        activation_checkpointing=checkpointed,
    )
    merged = lora_shape(name, 4, "attention", moe_experts="all").merged_expert_numel
    predicted = expert_adapter_flops(scn, merged, scn.checkpointed(2)) * seq
    assert step_flops("all") - step_flops("none") == predicted
    # flops_per_token charges it in place of 2 x the expert adapters' trainable factors.
    none = dataclasses.replace(scn, lora_moe_experts="none")
    extra = flops_per_token(scn)[0] - flops_per_token(none)[0]
    assert extra == pytest.approx(predicted / seq)


@pytest.mark.slow
def test_a_mixed_attention_family_is_traced_per_layer_type() -> None:
    """Gemma-3's 5 sliding : 1 full layers (`layer_types`), here 12 tiny layers with a window of 64 under a
    256-token sequence: the trace adds a (sliding, full) pair and counts each type's layers by its own
    increment (a full layer saves no window mask), as the analytic model counts 10 masked layers of 12."""
    from zerofit.catalogue.gpus import GIB

    name = _tiny("google/gemma-3-12b-pt")
    catalogue.CATALOGUE[name] = {**catalogue.CATALOGUE[name], "num_hidden_layers": 12}
    scn = Scenario(model=name, seq_len=256, micro_batch_size=1, lora=True)
    assert model_shape(name).sliding_layers == 10
    result = trace_memory(scn)
    one, sliding, full = result.layers
    assert [t.label for t in result.layers] == [
        "1 (sliding_attention)",
        "2 (sliding_attention, sliding_attention)",
        "2 (sliding_attention, full_attention)",
    ]
    assert full.peak_bytes < sliding.peak_bytes  # the full layer's increment: no window mask
    expected = (
        one.peak_bytes + 9 * (sliding.peak_bytes - one.peak_bytes) + 2 * (full.peak_bytes - one.peak_bytes)
    )
    assert result.traced_gib * GIB == pytest.approx(expected)
    assert abs(estimate(scn).tensors_gib / result.tensors_gib - 1) < 0.05
