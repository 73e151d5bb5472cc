"""Build the model to train: one ordered pipeline from a config to a ready (unwrapped) module.

    resolve path -> load (dtype, quantization) -> k-bit preparation -> LoRA -> activation checkpointing
    -> use_cache off -> train mode

The strategy wraps the result (DeepSpeed engine, FSDP2 shards, DDP); nothing here knows about ranks.
The order matters: quantization happens at load time; k-bit preparation freezes the base and upcasts
what is not quantized before peft adds adapters; checkpointing is enabled on the Hugging Face model
underneath peft so each decoder layer is recomputed (non-reentrant) in backward.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.config.schema import TINY_LLAMA, ZerofitConfig
from zerofit.tiny_llama import ensure_tiny_llama

log = logging.getLogger(__name__)

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def lora_config(r: int, alpha: int, dropout: float, target_modules: str | list[str], use_dora: bool) -> Any:
    """The peft `LoraConfig` zerofit uses everywhere (training and the planner's meta builds).

    Causal-LM task, no bias training; `all-linear` = every linear layer but the output head.
    """
    from peft import LoraConfig

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        use_dora=use_dora,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, config: Any, seed: int | None = None) -> torch.nn.Module:
    """Wrap `model` with peft adapters; with `seed`, adapter init is reproducible on every rank and split.

    Adapter init (kaiming A) draws from the global RNG: seeding it from the run's seed makes every rank and
    every split start from the same adapters, without disturbing the caller's RNG stream.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft still asks the deprecated `is_gradient_checkpointing`; nothing for a user to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if seed is not None:
            torch.manual_seed(seed)
        return get_peft_model(model, config)


@dataclass
class BuiltModel:
    """The model to hand to a strategy, its tokenizer, and facts the run prints and records."""

    model: torch.nn.Module
    tokenizer: Any
    total_params: int
    trainable_params: int
    load_dtype: torch.dtype


def resolve_model_path(cfg: ZerofitConfig) -> str:
    """`tiny-llama` becomes the built-in model's cache folder (built once per seed); anything else as given."""
    if cfg.model.name_or_path == TINY_LLAMA:
        return str(ensure_tiny_llama(cfg.seed))
    return cfg.model.name_or_path


def load_dtype(cfg: ZerofitConfig) -> torch.dtype:
    """The dtype the weights are loaded in (the dtype rule).

    - precision fp32: fp32 weights.
    - bf16/fp16 with LoRA (or QLoRA): the frozen base weights in that half dtype (half the memory, and
      they never receive updates); peft keeps the LoRA adapter weights in fp32 (`autocast_adapter_dtype`)
      so the optimizer updates full-precision values.
    - bf16/fp16 full fine-tuning: fp32 weights (master copy); mixed precision comes from the engine
      (autocast for single/DDP, MixedPrecisionPolicy for FSDP2; DeepSpeed casts to bf16/fp16 itself).
    """
    precision = cfg.train.precision
    if precision in _HALF and cfg.lora.enabled:
        return _HALF[precision]
    return torch.float32


def _quantization_config(cfg: ZerofitConfig) -> Any | None:
    """The bitsandbytes config for `quantization.load_in` 4bit/8bit, or None (no quantization)."""
    load_in = cfg.quantization.load_in
    if load_in == "none":
        return None
    from transformers import BitsAndBytesConfig

    if load_in == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    # 4-bit matmuls dequantize to the compute dtype: the run's precision (fp32 for precision fp32).
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quantization.quant_type,
        bnb_4bit_use_double_quant=cfg.quantization.double_quant,
        bnb_4bit_compute_dtype=_HALF.get(cfg.train.precision, torch.float32),
    )


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; 4-bit packed weights count as the parameters they hold."""
    total = trainable = 0
    for param in model.parameters():
        n = param.numel()
        if param.__class__.__name__ == "Params4bit":
            # Two 4-bit values per byte of the storage dtype (as peft's own counter does).
            n *= 2 * param.quant_storage.itemsize if hasattr(param, "quant_storage") else 2
        total += n
        if param.requires_grad:
            trainable += n
    return total, trainable


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model underneath a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def load_tokenizer(cfg: ZerofitConfig) -> Any:
    """The model's own tokenizer (seconds, no weights): the run tokenizes its data with it before the
    model loads, so bad data fails before a 7B load, not after.

    A tokenizer without a pad token (Llama-2, Mistral) pads with eos: padded positions are masked from
    attention and loss, so the id used there never matters.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_path(cfg), trust_remote_code=cfg.model.trust_remote_code
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(cfg: ZerofitConfig, *, device_map: Any = None, tokenizer: Any = None) -> BuiltModel:
    """Load and adapt the model described by `cfg`, ready for a strategy to wrap.

    `device_map` is passed to `from_pretrained` (e.g. `{"": local_rank}` to place quantized weights on a
    GPU at load time); None keeps everything on CPU, which the engines then move. `tokenizer`: one already
    loaded with `load_tokenizer` (else it is loaded here).
    """
    from transformers import AutoModelForCausalLM

    # 1. Where the weights are: the built-in tiny model is written once as a normal HF folder.
    path = resolve_model_path(cfg)

    # 2. Load with the dtype rule (see `load_dtype`) and, for QLoRA / 8-bit, bitsandbytes quantization.
    dtype = load_dtype(cfg)
    quant = _quantization_config(cfg)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=cfg.model.attn_implementation,
        quantization_config=quant,
        trust_remote_code=cfg.model.trust_remote_code,
        device_map=device_map,
    )

    # 3. Quantized base: freeze it and upcast the non-quantized parts (norms, embeddings, lm_head) to fp32
    #    for stable training. Checkpointing is left to step 5, so one place enables it for every model.
    if quant is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=False,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )

    # 4. LoRA adapters (peft): the base is frozen, only adapter weights train; they stay fp32 when the
    #    base is half precision (peft's `autocast_adapter_dtype=True` default).
    if cfg.lora.enabled:
        lora = cfg.lora
        config = lora_config(lora.r, lora.alpha, lora.dropout, lora.target_modules, lora.use_dora)
        model = apply_lora(model, config, seed=cfg.seed)

    # 5. Activation checkpointing, non-reentrant (the reentrant variant needs inputs that require grad and
    #    breaks with frozen embeddings). transformers 5 names it `activation_checkpointing_enable` (the old
    #    `gradient_checkpointing_enable` is a deprecated alias) and makes embedding outputs require grad.
    if cfg.train.activation_checkpointing:
        _hf_model(model).activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )

    # 6. No KV cache in training (it is useless there and conflicts with checkpointing); train mode so
    #    checkpointing and dropout are active from the first step.
    _hf_model(model).config.use_cache = False
    model.train()

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)

    total, trainable = count_parameters(model)
    log.info(
        "model %s: %s parameters, %s trainable (%.2f%%), loaded in %s",
        Path(path).name if Path(path).exists() else path,
        f"{total:,}",
        f"{trainable:,}",
        100.0 * trainable / max(total, 1),
        str(dtype).removeprefix("torch."),
    )
    return BuiltModel(
        model=model, tokenizer=tokenizer, total_params=total, trainable_params=trainable, load_dtype=dtype
    )
