"""A vision-language model's vision tower and projector, read from its `vision_config` dict alone
(`zerofit.catalogue.layouts`): every module that holds parameters, by full name, in transformers'
registration order, marked `vision`.

Qwen2-VL: a 3-D patch convolution, `depth` blocks (two LayerNorms with biases, a fused qkv and an output
projection, a two-linear MLP `mlp_ratio` wide, every linear with a bias), and the merger (a LayerNorm, then
two linears over `spatial_merge_size`^2 patches). Qwen2.5-VL: the same with RMSNorms (no bias) and a SwiGLU
MLP with biases, its widths given (`intermediate_size`, `out_hidden_size`). Any key these read must be given
(its class default is not this rule's to guess).

Pure (no torch, no transformers): the catalogue's layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerofit.catalogue.layout_parts import Part, need

__all__ = ["VISION_BLOCKS", "vision_parts"]

# The model types these rules read, and each one's class-name stem (its FSDP blocks:
# `<stem>DecoderLayer` and `<stem>VisionBlock`, what transformers' `_no_split_modules` declare).
VISION_BLOCKS = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}
_TOWER = "model.visual."


def vision_parts(model_type: str, vision: Mapping[str, Any]) -> tuple[Part, ...]:
    """The vision tower's and projector's parts of a `model_type` in `VISION_BLOCKS` (raises `Undecided`)."""
    qwen25 = model_type == "qwen2_5_vl"
    width = int(need(vision, "hidden_size" if qwen25 else "embed_dim"))
    channels, patch = int(need(vision, "in_channels")), int(need(vision, "patch_size"))
    temporal, merge = int(need(vision, "temporal_patch_size")), int(need(vision, "spatial_merge_size"))
    out = int(need(vision, "out_hidden_size" if qwen25 else "hidden_size"))
    if qwen25:
        ffn = int(need(vision, "intermediate_size"))
        mlp = [("gate_proj", width, ffn), ("up_proj", width, ffn), ("down_proj", ffn, width)]
    else:
        ffn = int(width * need(vision, "mlp_ratio"))
        mlp = [("fc1", width, ffn), ("fc2", ffn, width)]
    block = [
        Part("norm1", "norm", width, width, not qwen25),
        Part("norm2", "norm", width, width, not qwen25),
        Part("attn.qkv", "linear", width, 3 * width, True),
        Part("attn.proj", "linear", width, width, True),
        *(Part(f"mlp.{name}", "linear", n_in, n_out, True) for name, n_in, n_out in mlp),
    ]
    merged = width * merge**2
    parts = [Part("patch_embed.proj", "tensor", channels * temporal * patch * patch, width)]
    parts += [_renamed(p, f"blocks.{i}.{p.name}") for i in range(int(need(vision, "depth"))) for p in block]
    parts += [
        Part("merger.ln_q", "norm", width, width, not qwen25),
        Part("merger.mlp.0", "linear", merged, merged, True),
        Part("merger.mlp.2", "linear", merged, out, True),
    ]
    return tuple(_renamed(p, _TOWER + p.name) for p in parts)


def _renamed(part: Part, name: str) -> Part:
    """`part` under another name, marked as the vision tower's."""
    return Part(name, part.kind, part.in_features, part.out_features, part.bias, vision=True)
