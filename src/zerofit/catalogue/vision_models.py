"""The built-in tiny vision-language models: one per family, random-init, small enough to train on CPU.

Each entry is the config.json the builder (`zerofit.models.tiny_vision`) writes, less the token ids of the
image tokens, which the builder reads off the tokenizer it builds. The language model has the tiny
language models' shape; the vision tower is one or two blocks wide enough to run its real code path.
"""

from __future__ import annotations

from typing import Any

TINY_QWEN2_VL = "tiny-qwen2-vl"
TINY_LLAVA = "tiny-llava"
TINY_MLLAMA = "tiny-mllama"
TINY_GEMMA3_VL = "tiny-gemma3-vl"
TINY_SMOLVLM = "tiny-smolvlm"

# Qwen2-VL: a ViT over 14 x 14 patches (2 frames per patch: temporal_patch_size), 2 x 2 patches merged into
# one language-model token by the projector (`visual.merger`); M-RoPE splits each head's rotary pairs over
# (time, height, width): mrope_section sums to head_dim / 2.
_QWEN2_VL: dict[str, Any] = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen2_vl_text",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    },
    "vision_config": {
        "model_type": "qwen2_vl_vision",
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    },
}

# LLaVA (1.5): a CLIP ViT (28 x 28 pixels, 14-pixel patches: 4 patch tokens after the CLS is dropped,
# `vision_feature_select_strategy: default`) and a 2-layer MLP projector in front of a Llama.
_LLAVA: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "text_config": {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
        "projection_dim": 32,
    },
}

# Llama 3.2 Vision (Mllama): a tiled ViT (28 x 28-pixel tiles, up to 2 per image, 14-pixel patches: 5 vision
# tokens per tile with the CLS), its local then gated global encoder, a linear projector of the last and
# intermediate states; the language model (a Llama) reads them through cross-attention layers
# (`cross_attention_layers`), each image one `<|image|>` token in the text.
_MLLAMA: dict[str, Any] = {
    "architectures": ["MllamaForConditionalGeneration"],
    "model_type": "mllama",
    "text_config": {
        "model_type": "mllama_text_model",
        "vocab_size": 128,
        # The tiny tokenizer's padding id (the builder sets it from the tokenizer too): a shape-only build of
        # this entry (the planner's) would otherwise take Llama 3's 128004, outside this vocabulary.
        "pad_token_id": 0,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "cross_attention_layers": [1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "vision_config": {
        "model_type": "mllama_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_global_layers": 1,
        "attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
        "max_num_tiles": 2,
        "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
        "intermediate_layers_indices": [0],
        "vision_output_dim": 64,  # hidden_size x (1 + len(intermediate_layers_indices))
    },
}

# Gemma 3 (vision): a SigLIP ViT (56 x 56 pixels, 14-pixel patches: 4 x 4 patches) whose output the projector
# average-pools to `mm_tokens_per_image` (2 x 2 = 4) tokens per image, in front of a Gemma 3 language model
# (a sliding-window and a global layer, as tiny-gemma3); image tokens attend to each other both ways.
_GEMMA3_VL: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "mm_tokens_per_image": 4,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "gemma3_text",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": True,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "vision_use_head": False,
    },
}

# SmolVLM (Idefics3's architecture, the small one users fine-tune on small cards): each image is resized to at
# most 112 pixels a side and split into 56 x 56 tiles plus the whole image shrunk to one tile; a tile's 4 x 4
# patches become 2 x 2 tokens by the connector's pixel shuffle (`scale_factor` 2), in front of a Llama.
_SMOLVLM: dict[str, Any] = {
    "architectures": ["SmolVLMForConditionalGeneration"],
    "model_type": "smolvlm",
    "scale_factor": 2,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    },
    "vision_config": {
        "model_type": "smolvlm_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
    },
}

TINY_VLM_CONFIGS: dict[str, dict[str, Any]] = {
    TINY_QWEN2_VL: _QWEN2_VL,
    TINY_LLAVA: _LLAVA,
    TINY_GEMMA3_VL: _GEMMA3_VL,
    TINY_SMOLVLM: _SMOLVLM,
    TINY_MLLAMA: _MLLAMA,
}

# Vision-language models at a real size, for the planner (values from each model's config.json on the hub).
QWEN25_VL_7B = "Qwen/Qwen2.5-VL-7B-Instruct"
LLAMA32_11B_VISION = "meta-llama/Llama-3.2-11B-Vision-Instruct"
VLM_CATALOGUE: dict[str, dict[str, Any]] = {
    # Qwen2.5-VL-7B-Instruct: the Qwen2.5-7B language model (M-RoPE) behind a 32-block ViT of width 1280 over
    # 14 x 14 patches (2 frames: temporal_patch_size) with window attention (112-pixel windows; blocks 7, 15,
    # 23, 31 attend the whole image), its 2 x 2 patches merged into one 3584-wide token by `visual.merger`.
    QWEN25_VL_7B: {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": False,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "text_config": {
            "model_type": "qwen2_5_vl_text",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [16, 24, 24],
            },
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
        "vision_config": {
            "model_type": "qwen2_5_vl_vision",
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 3584,
            "hidden_act": "silu",
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "in_channels": 3,
            "tokens_per_second": 2,
        },
    },
    # Llama-3.2-11B-Vision-Instruct (mllama): a Llama 3.1 8B language model with 8 gated cross-attention
    # layers added among its 40 (they attend the image's states, not the text), a 32 + 8-layer ViT over up
    # to 4 tiles of 560 x 560 pixels (40 x 40 patches + a class token per tile), projected from 7680 to 4096.
    LLAMA32_11B_VISION: {
        "architectures": ["MllamaForConditionalGeneration"],
        "model_type": "mllama",
        "image_token_index": 128256,
        "text_config": {
            "model_type": "mllama_text_model",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
            "bos_token_id": 128000,
            "eos_token_id": 128009,
            "pad_token_id": 128004,
        },
        "vision_config": {
            "model_type": "mllama_vision_model",
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_global_layers": 8,
            "attention_heads": 16,
            "image_size": 560,
            "patch_size": 14,
            "max_num_tiles": 4,
            "num_channels": 3,
            "vision_output_dim": 7680,
            "intermediate_layers_indices": [3, 7, 15, 23, 30],
            "norm_eps": 1e-5,
            "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]],
        },
    },
}
# Their image processors' limits (preprocessor_config.json on the hub): Qwen's fewest and most pixels per
# image (an image is resized, aspect kept, into that range on the 28-pixel grid).
VLM_PIXEL_LIMITS: dict[str, tuple[int, int]] = {QWEN25_VL_7B: (3136, 12845056)}


def is_tiny_vlm(name: str) -> bool:
    """Whether `model.name_or_path` names a built-in tiny vision-language model (`tiny-qwen2-vl`, ...)."""
    return name in TINY_VLM_CONFIGS
