"""The built-in tiny vision-language models (`tiny-qwen2-vl`, ...): random-init models of each family's own
transformers class, with the family's own processor (its image processor's resizing rules, its image
tokens) over the tiny models' character tokenizer, and a chat template that renders image parts as the
family's real template does. Written once to the cache like the tiny language models (`zerofit.models.tiny`):
config, weights, tokenizer and processor files, then every load goes through `from_pretrained` /
`AutoProcessor.from_pretrained` as a real model's would. Nothing is downloaded; no torchvision is needed (the
image processors' PIL backend).
"""

from __future__ import annotations

import copy
from pathlib import Path

from zerofit.catalogue.vision_models import TINY_LLAVA, TINY_MLLAMA, TINY_QWEN2_VL, TINY_VLM_CONFIGS
from zerofit.models.tiny import (
    TinyFamily,
    build_once,
    char_tokenizer,
    tiny_model_path,
    write_marker,
)
from zerofit.models.tiny_mllama import mllama_files
from zerofit.models.tiny_vision_families import (
    FAMILY_BUILDERS,  # Gemma 3 (vision), SmolVLM
    text_token_ids,
)
from zerofit.models.tiny_vision_families import write_model as _write_model

# Qwen2-VL's ChatML, with content parts: an image part renders as the family's vision span, whose one
# `<|image_pad|>` the processor expands to the image's tokens. Assistant text is marked `{% generation %}`.
_PARTS = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
_QWEN2_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}" + _PARTS + "{{- '<|im_end|>' -}}{%- endgeneration -%}{{- '\n' -}}"
    "{%- else -%}" + _PARTS + "{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
_QWEN2_VL_FAMILY = TinyFamily(
    _QWEN2_VL_TEMPLATE,
    ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "<|im_end|>",
)
# The image processor's limits: 56 x 56 to 112 x 112 pixels, i.e. 4 to 16 image tokens (28 x 28 pixels each:
# a 14-pixel patch, 2 x 2 patches merged), so a CPU step stays fast.
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 56 * 56, 112 * 112


def _qwen2_vl_files(folder: Path, seed: int) -> None:
    """Write tiny Qwen2-VL's config, weights, tokenizer and processor into `folder`."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = copy.deepcopy(TINY_VLM_CONFIGS[TINY_QWEN2_VL])
    text = data["text_config"]
    tokenizer = char_tokenizer(_QWEN2_VL_FAMILY, text["vocab_size"], text["max_position_embeddings"])
    ids = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    data.update({key: tokenizer.convert_tokens_to_ids(tok) for key, tok in ids.items()})
    text_token_ids(text, tokenizer)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    _write_model(folder, getattr(transformers, data["architectures"][0]), config, seed)
    # The image processor's preprocessor_config.json, as a real model ships it (the processor class itself
    # needs torchvision for its video half, which zerofit does not: `zerofit.models.vision` pairs the image
    # processor with the tokenizer and its chat template instead).
    Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_marker(folder)


# LLaVA's ChatML here renders an image part as its one `<image>` token, which the processor's rule expands to
# the image's patch tokens.
_LLAVA_PARTS = _PARTS.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
_LLAVA_TEMPLATE = _QWEN2_VL_TEMPLATE.replace(_PARTS, _LLAVA_PARTS)
_LLAVA_FAMILY = TinyFamily(_LLAVA_TEMPLATE, ("<|im_start|>", "<|im_end|>", "<image>"), "<|im_end|>")


def _llava_files(folder: Path, seed: int) -> None:
    """Write tiny LLaVA's config, weights, tokenizer and image processor (CLIP's, PIL backend) into `folder`."""
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    data = copy.deepcopy(TINY_VLM_CONFIGS[TINY_LLAVA])
    text = data["text_config"]
    tokenizer = char_tokenizer(_LLAVA_FAMILY, text["vocab_size"], text["max_position_embeddings"])
    data["image_token_id"] = tokenizer.convert_tokens_to_ids("<image>")
    text_token_ids(text, tokenizer)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    _write_model(folder, getattr(transformers, data["architectures"][0]), config, seed)
    side = data["vision_config"]["image_size"]
    CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_marker(folder)


_BUILDERS = {TINY_QWEN2_VL: _qwen2_vl_files, TINY_LLAVA: _llava_files, **FAMILY_BUILDERS}
_BUILDERS[TINY_MLLAMA] = lambda folder, seed: mllama_files(folder, seed, _write_model)
assert set(_BUILDERS) == set(TINY_VLM_CONFIGS), "every built-in vision-language model has a builder"


def ensure_tiny_vlm(name: str, seed: int = 0) -> Path:
    """The folder of built-in vision-language model `name` for `seed`, built once per machine (`build_once`)."""
    return build_once(name, tiny_model_path(name, seed), lambda folder: _BUILDERS[name](folder, seed))
