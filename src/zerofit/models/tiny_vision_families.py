"""The built-in tiny Gemma 3 (vision) and SmolVLM models (`tiny-gemma3-vl`, `tiny-smolvlm`): as
`zerofit.models.tiny_vision` builds the others, each family's own transformers class at random init, its own
image processor (PIL backend: no torchvision) and a chat template that renders image parts as the family's
real template does (the placeholder the processor expands: Gemma 3's `<start_of_image>`, SmolVLM's `<image>`),
assistant text marked `{% generation %}`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from zerofit.catalogue.vision_models import TINY_GEMMA3_VL, TINY_SMOLVLM, TINY_VLM_CONFIGS
from zerofit.models.tiny import TinyFamily, char_tokenizer, unshared_weights, write_marker

# Gemma 3's template (google/gemma-3-*-it): no system role (a system text goes first in the first user turn),
# the assistant is `model`, text parts trimmed, an image part rendered as `<start_of_image>`, which the
# processor expands to "\n\n<start_of_image>" + `<image_soft_token>` x mm_tokens_per_image + "<end_of_image>\n\n".
_GEMMA3_PARTS = (
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
_GEMMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- set first = (system if system is string else system | map(attribute='text') | join('')) + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<start_of_turn>model\n' -}}"
    "{%- generation -%}" + _GEMMA3_PARTS + "{{- '<end_of_turn>' -}}{%- endgeneration -%}{{- '\n' -}}"
    "{%- else -%}"
    "{{- '<start_of_turn>user\n' + (first if loop.first else '') -}}"
    + _GEMMA3_PARTS
    + "{{- '<end_of_turn>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
_GEMMA3_FAMILY = TinyFamily(
    _GEMMA3_TEMPLATE,
    ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"),
    "<end_of_turn>",
)

# SmolVLM's template (HuggingFaceTB/SmolVLM-*-Instruct): one `<|im_start|>`, then `User:` / `Assistant:` turns
# each ended by `<end_of_utterance>`; an image part is `<image>`, which the processor expands per the image's
# tiles (`<fake_token_around_image>`, `<row_i_col_j>` / `<global-img>`, then the tile's `<image>` tokens).
_SMOLVLM_PARTS = (
    "{%- if message['content'] is string -%}{{- ': ' + message['content'] -}}"
    "{%- else -%}"
    "{%- if message['content'][0]['type'] == 'image' -%}{{- ':' -}}{%- else -%}{{- ': ' -}}{%- endif -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<image>' -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
_SMOLVLM_TEXT = (  # an assistant turn: text only (zerofit refuses an image there)
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}{{- part['text'] -}}{%- endfor -%}{%- endif -%}"
)
_SMOLVLM_TEMPLATE = (
    "{{- '<|im_start|>' -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] | capitalize -}}"
    "{%- if message['role'] == 'assistant' -%}{{- ':' -}}"  # the generation prompt ends at `Assistant:`
    "{%- generation -%}{{- ' ' -}}" + _SMOLVLM_TEXT + "{{- '<end_of_utterance>' -}}{%- endgeneration -%}"
    "{{- '\n' -}}"
    "{%- else -%}" + _SMOLVLM_PARTS + "{{- '<end_of_utterance>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)
# The tiles' row / column markers up to the tiny processor's largest split (112 pixels over 56-pixel tiles).
_SMOLVLM_GRID = tuple(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2))
_SMOLVLM_FAMILY = TinyFamily(
    _SMOLVLM_TEMPLATE,
    (
        "<|im_start|>",
        "<end_of_utterance>",
        "<image>",
        "<fake_token_around_image>",
        "<global-img>",
        *_SMOLVLM_GRID,
    ),
    "<end_of_utterance>",
)


def write_model(folder: Path, model_class: Any, config: Any, seed: int) -> None:
    """Seeded random weights of `model_class(config)` saved as `save_pretrained` would (`tiny._build_into`)."""
    from safetensors.torch import save_file

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_file(unshared_weights(model), folder / "model.safetensors", metadata={"format": "pt"})


def text_token_ids(text: dict[str, Any], tokenizer: Any) -> None:
    """The language model's special ids, read off the tiny tokenizer."""
    text["bos_token_id"] = tokenizer.bos_token_id
    text["eos_token_id"] = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    text["pad_token_id"] = tokenizer.pad_token_id


def _gemma3_vl_files(folder: Path, seed: int) -> None:
    """Write tiny Gemma 3 (vision)'s config, weights, tokenizer and image processor (Gemma 3's, PIL backend:
    every image resized to the tower's 56 x 56) into `folder`."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    data = copy.deepcopy(TINY_VLM_CONFIGS[TINY_GEMMA3_VL])
    text = data["text_config"]
    tokenizer = char_tokenizer(_GEMMA3_FAMILY, text["vocab_size"], text["max_position_embeddings"])
    ids = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
           "image_token_index": "<image_soft_token>"}  # fmt: skip
    data.update({key: tokenizer.convert_tokens_to_ids(tok) for key, tok in ids.items()})
    text_token_ids(text, tokenizer)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    write_model(folder, getattr(transformers, data["architectures"][0]), config, seed)
    side = data["vision_config"]["image_size"]
    Gemma3ImageProcessorPil(size={"height": side, "width": side}).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_marker(folder)


def _smolvlm_files(folder: Path, seed: int) -> None:
    """Write tiny SmolVLM's config, weights, tokenizer and image processor (SmolVLM's, PIL backend: an image
    resized to at most 112 pixels a side, split into 56 x 56 tiles plus the whole image as one) into `folder`."""
    import transformers
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    data = copy.deepcopy(TINY_VLM_CONFIGS[TINY_SMOLVLM])
    text = data["text_config"]
    tokenizer = char_tokenizer(_SMOLVLM_FAMILY, text["vocab_size"], text["max_position_embeddings"])
    data["image_token_id"] = tokenizer.convert_tokens_to_ids("<image>")
    text_token_ids(text, tokenizer)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    write_model(folder, getattr(transformers, data["architectures"][0]), config, seed)
    side = data["vision_config"]["image_size"]
    SmolVLMImageProcessorPil(
        size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side}
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_marker(folder)


FAMILY_BUILDERS = {TINY_GEMMA3_VL: _gemma3_vl_files, TINY_SMOLVLM: _smolvlm_files}
