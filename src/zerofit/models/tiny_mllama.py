"""The built-in tiny Llama 3.2 Vision (`tiny-mllama`): transformers' `MllamaForConditionalGeneration` at the
catalogue's tiny shape (`zerofit.catalogue.vision_models`), with Mllama's own image processor (PIL backend:
its tiling, aspect-ratio ids and masks) over the tiny models' character tokenizer, and a chat template like
Llama 3.2 Vision's (an image part is one `<|image|>` token; the assistant text marked `{% generation %}`).
`zerofit.models.tiny_vision` builds it once into the cache like the other built-in vision-language models.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerofit.catalogue.vision_models import TINY_MLLAMA, TINY_VLM_CONFIGS
from zerofit.models.tiny import TinyFamily, char_tokenizer, write_marker
from zerofit.models.tiny_vision_families import text_token_ids

_PARTS = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|image|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
_MLLAMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}" + _PARTS + "{{- '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- else -%}" + _PARTS + "{{- '<|eot_id|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)
_MLLAMA_FAMILY = TinyFamily(
    _MLLAMA_TEMPLATE,
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|image|>"),
    "<|eot_id|>",
)
# The tanh gates of the cross-attention layers and the tiled position embeddings: transformers initializes
# them to 0 (a fresh Mllama ignores its images), a trained one has them open. The tiny model opens them so its
# images reach the text and a test of the cross-attention path can fail.
_GATE = 0.5


def _open_gates(folder: Path) -> None:
    """Set every gate of the saved weights to `_GATE` (the file rewritten in place, before the marker)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    for name, tensor in weights.items():
        if name.endswith("gate"):
            weights[name] = torch.full_like(tensor, _GATE)
    save_file(weights, path, metadata={"format": "pt"})


def mllama_files(folder: Path, seed: int, write_model: Callable[[Path, Any, Any, int], None]) -> None:
    """Write tiny Mllama's config, weights (`write_model`: the built-ins' seeded writer, handed in by
    `zerofit.models.tiny_vision`), tokenizer and image processor into `folder`."""
    import transformers
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    data = copy.deepcopy(TINY_VLM_CONFIGS[TINY_MLLAMA])
    text = data["text_config"]
    tokenizer = char_tokenizer(_MLLAMA_FAMILY, text["vocab_size"], text["max_position_embeddings"])
    data["image_token_index"] = tokenizer.convert_tokens_to_ids("<|image|>")
    text_token_ids(text, tokenizer)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    write_model(folder, transformers.MllamaForConditionalGeneration, config, seed)
    _open_gates(folder)
    vision = data["vision_config"]
    side = vision["image_size"]
    MllamaImageProcessorPil(
        size={"height": side, "width": side}, max_image_tiles=vision["max_num_tiles"]
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_marker(folder)
