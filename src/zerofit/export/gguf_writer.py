"""A merged Hugging Face causal LM as one GGUF file, the way llama.cpp's `convert_hf_to_gguf.py` writes it.

    architecture    llama (Llama 2/3, tiny-llama) and mistral as llama.cpp's `llama`; qwen2; qwen3
    tensor names    gguf's own `TensorNameMap` for that architecture (the map transformers' GGUF reader
                    inverts); q_proj / k_proj of llama-type models permuted to llama.cpp's rotary layout
                    (`LlamaModel.permute` of the converter; the reader undoes it); a tied lm_head left
                    out (readers tie `output` to `token_embd` when it is absent)
    metadata        context length, sizes, head counts, RoPE base and scaling (linear, yarn, llama3's
                    per-frequency factors as the `rope_freqs` tensor), RMS norm eps, vocab, file type
    tensor types    1-D tensors (norms, biases) in F32; the rest in the chosen type; Q8_0 needs rows in
                    blocks of 32, and a tensor whose rows are not stays F16 (the converter's fallback)

The file types are the ones gguf's own quantizers write as llama.cpp's converter offers them (`QUANTS`); the
k-quants (Q4_K_M ...) and the other legacy types come from llama.cpp's `llama-quantize`, run on the f16 file
(`check_quant` says how). The file is written under a temporary name in its folder and renamed into place,
so a failed or interrupted export never leaves a partial `.gguf`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerofit.core.errors import ConfigError
from zerofit.export.gguf_tokenizer import gguf_vocab, write_vocab

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_QUANT",
    "QUANTS",
    "GGUFFile",
    "check_architecture",
    "check_quant",
    "write_gguf",
]

# --quant -> (ggml tensor type, llama.cpp file type), by name (gguf.GGMLQuantizationType / LlamaFileType).
QUANTS: dict[str, tuple[str, str]] = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}
# f16: llama.cpp's converter's default, which every llama.cpp backend runs; 10 mantissa bits keep the fp32
# merge closer than bf16's 7, and trained weights lie far inside its range (checked: |w| <= 65504).
DEFAULT_QUANT = "f16"
# Hugging Face model_type -> (gguf architecture, q/k permuted to llama.cpp's rotary layout). llama.cpp
# converts Mistral as `llama` (no sliding window, as llama.cpp's own conversion).
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LLAMA", True),
    "mistral": ("LLAMA", True),
    "qwen2": ("QWEN2", False),
    "qwen3": ("QWEN3", False),
}
_F16_MAX = 65504.0


@dataclass
class GGUFFile:
    """What `write_gguf` wrote."""

    path: Path
    quant: str
    tensors: int = 0
    kept_f16: list[str] = field(default_factory=list)  # Q8_0: tensors whose rows are not blocks of 32

    @property
    def size_bytes(self) -> int:
        """Bytes of the file."""
        return self.path.stat().st_size


def check_quant(quant: str, stem: str = "model") -> str:
    """`--quant` normalized (`Q8_0` -> `q8_0`); `ConfigError` naming what writes it otherwise."""
    import gguf

    name = quant.strip().lower()
    if name in QUANTS:
        return name
    llama_cpp_types = {t.name.removeprefix("MOSTLY_").lower() for t in gguf.LlamaFileType}
    if name in llama_cpp_types:
        raise ConfigError(
            [
                f"--quant {quant}: the gguf package cannot write {name.upper()} (zerofit writes "
                f"{', '.join(QUANTS)}); llama.cpp's quantizer makes it from the f16 file: export with "
                f"--quant f16, then run `llama-quantize {stem}-f16.gguf {stem}-{name}.gguf {name.upper()}` "
                "(llama-quantize comes with llama.cpp: brew install llama.cpp, or its release binaries)"
            ]
        )
    raise ConfigError(
        [
            f"--quant {quant}: not a GGUF file type; zerofit writes {', '.join(QUANTS)} (default "
            f"{DEFAULT_QUANT}), and llama.cpp's llama-quantize makes the others (q4_k_m, q5_k_m, q6_k, ...) "
            "from the f16 file"
        ]
    )


def check_architecture(config: Any) -> tuple[str, bool]:
    """(gguf architecture name, permute q/k) for a model config; `ConfigError` for any other family."""
    import gguf

    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            [
                f"--format gguf: the model is a {model_type!r} ({', '.join(getattr(config, 'architectures', None) or [])}), "
                f"and zerofit writes GGUF for {', '.join(ARCHITECTURES)} only (those whose tensor layout it "
                "checks by loading the file back with transformers' GGUF reader); export with --merge "
                "(Hugging Face safetensors) and convert that folder with llama.cpp's convert_hf_to_gguf.py"
            ]
        )
    arch, permute = ARCHITECTURES[model_type]
    return gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)], permute


def _rope(config: Any) -> dict[str, Any]:
    """The model's RoPE parameters (transformers 5's `rope_parameters`, or 4's `rope_theta` + `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **dict(params)}


def _head_dim(config: Any) -> int:
    """Per-head width: the config's `head_dim` (Qwen 3 sets it apart), else hidden / heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _llama3_rope_factors(config: Any, rope: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's per-frequency RoPE factors, as llama.cpp's converter computes its `rope_freqs` tensor."""
    dim = _head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _write_rope(writer: Any, config: Any, with_dimension: bool) -> np.ndarray | None:
    """RoPE metadata; returns llama3's `rope_freqs` factors when the model scales that way."""
    import gguf

    rope = _rope(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if with_dimension:
        writer.add_rope_dimension_count(_head_dim(config))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind == "llama3":
        return _llama3_rope_factors(config, rope)
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(
            gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN
        )
        writer.add_rope_scaling_factor(float(rope["factor"]))
        if kind == "yarn" and "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        return None
    raise ConfigError(
        [
            f"--format gguf: the model's RoPE scaling {kind!r} is not one zerofit writes to GGUF (default, linear, "
            "yarn, llama3); export with --merge and convert with llama.cpp's convert_hf_to_gguf.py"
        ]
    )


def _write_hparams(writer: Any, config: Any, name: str, quant: str, permute: bool) -> np.ndarray | None:
    """The model's shape, RoPE and file type as llama.cpp's keys; returns llama3's RoPE factors, if any."""
    import gguf

    writer.add_name(name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    if _head_dim(config) != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(_head_dim(config))
        writer.add_value_length(_head_dim(config))
    writer.add_file_type(int(getattr(gguf.LlamaFileType, QUANTS[quant][1])))
    if quant == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return _write_rope(writer, config, with_dimension=permute)


def _permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute`: HF's rotate-half layout of q/k rows -> the interleaved pairs
    llama.cpp's rope expects (per head, rows [0..d/2) and [d/2..d) interleaved)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _encode(name: str, data: np.ndarray, quant: str, result: GGUFFile) -> tuple[np.ndarray, Any]:
    """(bytes or floats to store, ggml type) for tensor `name`."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, QUANTS[quant][0])
    if data.ndim <= 1 or qtype == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32), gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        result.kept_f16.append(name)
        qtype = gguf.GGMLQuantizationType.F16
    if qtype == gguf.GGMLQuantizationType.F16 and float(np.abs(data).max(initial=0.0)) > _F16_MAX:
        raise ConfigError(
            [
                f"--quant {quant}: tensor {name} holds values beyond float16's range (|w| > {_F16_MAX:g}), "
                "which f16 would turn into infinities; export with --quant bf16 (float32's range) instead"
            ]
        )
    return gguf.quants.quantize(data, qtype), qtype


def _tensors(model: Any, arch: str, permute: bool) -> list[tuple[str, torch.Tensor]]:
    """(gguf name, tensor) for every weight of `model`, mapped and permuted; `ConfigError` for one with no
    GGUF name (never drop a weight silently)."""
    import gguf

    config = model.config
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_enum, int(config.num_hidden_layers))
    n_head = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_head)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = []
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # the reader ties it to token_embd again
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the RoPE metadata
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(
                [
                    f"--format gguf: the model's tensor {hf_name} has no name in gguf's {arch} tensor map, so "
                    "llama.cpp would not load it; export with --merge and convert with llama.cpp's "
                    "convert_hf_to_gguf.py"
                ]
            )
        tensor = tensor.detach().to(torch.float32)
        if permute and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _permute(tensor, n_head, n_head)
        elif permute and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _permute(tensor, n_head, n_kv)
        out.append((name, tensor))
    return out


def write_gguf(model: Any, tokenizer: Any, path: Path, quant: str, name: str, chat: bool = False) -> GGUFFile:
    """Write `model` (a merged HF causal LM, any float dtype) with `tokenizer` as GGUF file `path`, tensors
    in `quant` (a `QUANTS` key), named `name` (`general.name`); atomically (module docstring). `chat`: the
    run trained on chat messages (whether prompts get bos, `gguf_tokenizer.bos_first`)."""
    import gguf

    arch, permute = check_architecture(model.config)
    result = GGUFFile(path=Path(path), quant=quant)
    writer = gguf.GGUFWriter(path=None, arch=arch)
    rope_factors = _write_hparams(writer, model.config, name, quant, permute)
    write_vocab(writer, gguf_vocab(tokenizer, int(model.config.vocab_size)), tokenizer, chat)
    if rope_factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_factors)
        result.tensors += 1
    for gguf_name, tensor in _tensors(model, arch, permute):
        data, qtype = _encode(gguf_name, tensor.numpy(), quant, result)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        result.tensors += 1
    tmp = result.path.with_name(f".{result.path.name}.tmp-{os.getpid()}")
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, result.path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return result
