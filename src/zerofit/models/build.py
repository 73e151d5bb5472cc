"""Build the model to train: one ordered pipeline from a config to a ready (unwrapped) module.

    resolve path -> load (dtype, quantization) -> k-bit preparation -> LoRA -> fused kernels (train.kernels)
    -> activation checkpointing (the first n decoder layers) -> activation offload (their saved inputs)
    -> tiled MLP -> lean RMSNorms -> the fused loss head (train.cross_entropy=fused_linear) -> the varlen
    attention kernel (model.attn_implementation=varlen) -> torch.compile of each decoder layer
    (train.compile) -> use_cache off -> train mode

The strategy wraps the result (DeepSpeed engine, FSDP2 shards, DDP); nothing here knows about ranks.
The order matters: quantization happens at load time; k-bit preparation freezes the base and upcasts
what is not quantized before peft adds adapters; the kernels rebind forwards the tiled MLP then wraps
(zerofit.levers.kernels); compiling last compiles each layer as every lever left it, inside its checkpoint
(zerofit.levers.compiling); checkpointing is enabled on the Hugging Face model
underneath peft so each checkpointed decoder layer is recomputed (non-reentrant) in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerofit.catalogue.models import is_pretrained_builtin, is_tiny_model, model_config_dict
from zerofit.catalogue.vision_models import is_tiny_vlm
from zerofit.config.rules.model import attention_choice, check_levers
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.core.lazy import import_bitsandbytes
from zerofit.core.precision import tensor_dtypes, torch_dtype
from zerofit.levers.attention import choose_kernel, hf_attn_implementation, install_kernel, installed_kernels
from zerofit.levers.compiling import compile_decoder_layers
from zerofit.levers.kernels import apply_kernels, hub_kernels_off, kernel_problems, require_liger
from zerofit.levers.layers import decoder_layers
from zerofit.levers.norms import check_lean_norm, enable_lean_norm
from zerofit.levers.offload import ActivationOffload, enable_activation_offload
from zerofit.levers.recompute import checkpointed_layers, enable_activation_checkpointing
from zerofit.levers.sequence_parallel import head_count_problem
from zerofit.levers.tiling import enable_tiled_mlp, tiled_mlp_shards
from zerofit.models.heads import (
    SCORE_HEAD,
    auto_model_class,
    head_kwargs,
    is_reward_model,
    seeded_head,
    set_pad_token,
)
from zerofit.models.hub import hub_errors
from zerofit.models.lora import (
    AdapterSpec,
    adapted_counts,
    apply_lora,
    check_model_targets,
    lora_config,
    model_targets,
)
from zerofit.models.pretrained import ensure_pretrained
from zerofit.models.safe_weights import safetensors_only
from zerofit.models.tiny import ensure_tiny_model
from zerofit.models.tiny_vision import ensure_tiny_vlm
from zerofit.models.vision import (
    apply_vision_lora,
    is_vision_config,
    run_vision_every_step,
    unquantized_modules,
)
from zerofit.token_loss.fused import FUSED_LINEAR, install_fused_head


@dataclass
class BuiltModel:
    """The model to hand to a strategy, its tokenizer, and facts the run prints and records."""

    model: torch.nn.Module
    tokenizer: Any
    total_params: int
    trainable_params: int
    load_dtype: torch.dtype
    # The offload hooks when `train.activation_offload` is on (their `take_offloaded_bytes()` per step).
    activation_offload: ActivationOffload | None = None
    # The varlen path's kernel (`zerofit.levers.attention.KERNELS`) when model.attn_implementation is varlen.
    varlen_kernel: str | None = None
    compiled_layers: int = 0  # decoder layers compiled (`train.compile`), 0 when eager
    # What LoRA adapted, in words with its counts (`describe_adapters`); None without LoRA.
    adapters: str | None = None


def resolve_model_path(cfg: ZerofitConfig) -> str:
    """A built-in model (`tiny-llama`, `tiny-qwen3`, ... built once per seed; `smollm2-135m-instruct`
    converted once) becomes its cache folder; anything else as given."""
    if is_tiny_vlm(cfg.model.name_or_path):  # a built-in vision-language model (`models.tiny_vision`)
        return str(ensure_tiny_vlm(cfg.model.name_or_path, cfg.seed))
    if is_tiny_model(cfg.model.name_or_path):
        return str(ensure_tiny_model(cfg.model.name_or_path, cfg.seed))
    if is_pretrained_builtin(cfg.model.name_or_path):
        return str(ensure_pretrained(cfg.model.name_or_path))
    return cfg.model.name_or_path


def load_dtype(cfg: ZerofitConfig) -> torch.dtype:
    """The dtype the weights are loaded in (the dtype rule of `zerofit.core.precision`)."""
    dtypes = tensor_dtypes(cfg.train.precision, cfg.distributed.strategy, lora=cfg.lora.enabled)
    return torch_dtype(dtypes.load)


def _trained_routers(cfg: ZerofitConfig) -> tuple[str, ...]:
    """The router modules `lora.train_router` trains in full (`lora_targets`), as name suffixes."""
    from zerofit.models.lora_targets import resolve_lora_targets

    lora = cfg.lora
    try:
        model_config = model_config_dict(cfg.model.name_or_path)
    except ConfigError:
        return ()  # no config to read here: the LoRA check before the load reports the model
    targets = resolve_lora_targets(model_config, lora.target_modules, lora.moe_experts, lora.train_router)
    return targets.modules_to_save


def quantization_config(cfg: ZerofitConfig) -> Any | None:
    """The bitsandbytes config for `quantization.load_in` 4bit/8bit, or None (no quantization)."""
    load_in = cfg.quantization.load_in
    if load_in == "none":
        return None
    from transformers import BitsAndBytesConfig

    # A router trained in full (`lora.train_router`) stays a float nn.Linear: a quantized one has no float
    # weight to train. The skip list replaces transformers' default one, so lm_head is named again.
    skip = ["lm_head", *_trained_routers(cfg)] if cfg.lora.enabled and cfg.lora.train_router else None
    if is_reward_model(cfg):  # the score head trains in full: a float nn.Linear (`zerofit.models.heads`)
        skip = [SCORE_HEAD, *_trained_routers(cfg)]
    keep = unquantized_modules(cfg.model.name_or_path)  # a vision-language model's tower and projector
    skip = [*(skip or ["lm_head"]), *keep] if keep else skip
    if load_in == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    # 4-bit matmuls dequantize to the compute dtype: the run's precision (fp32 for precision fp32).
    return BitsAndBytesConfig(
        llm_int8_skip_modules=skip,
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quantization.quant_type,
        bnb_4bit_use_double_quant=cfg.quantization.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(cfg.train.precision),
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

    path = resolve_model_path(cfg)
    with hub_errors(cfg.model.name_or_path, "tokenizer", path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_attention_before_load(path: str, attn_implementation: str) -> None:
    """Refuse `model.attn_implementation` sdpa or varlen (both run torch's scaled_dot_product_attention or a
    kernel like it) for a model class transformers does not run sdpa for (Gemma-2: attention-logit
    soft-capping), from config.json's `architectures` alone, before any weight loads."""
    import transformers

    if attn_implementation not in ("sdpa", "varlen"):
        return
    try:
        archs = model_config_dict(path).get("architectures") or []
    except ConfigError:
        return  # no config here: the load reports it
    for arch in archs:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if cls is not None and getattr(cls, "_supports_sdpa", True) is False:
            raise ConfigError(
                [
                    f"model.attn_implementation = {attn_implementation!r}: {arch} does not run attention through torch's "
                    "scaled_dot_product_attention (transformers supports only eager or flash attention for it, "
                    "e.g. Gemma-2's attention-logit soft-capping). Fix: model.attn_implementation=eager"
                ]
            )


def check_lean_norm_before_load(path: str) -> None:
    """`train.lean_norm = true`: refuse a model whose norm class it does not know (`norms.check_lean_norm`)
    on a meta-device build (milliseconds), not after the weights load; best effort, like the LoRA check."""
    from zerofit.models.meta import build_meta_model

    try:
        meta = build_meta_model(path, attn_implementation="eager")
    except (ConfigError, ValueError, KeyError, ImportError):
        return  # custom code: `enable_lean_norm` checks the loaded model itself
    check_lean_norm(meta)


def check_kernels_before_load(path: str, kernels: str) -> None:
    """`train.kernels`: refuse a missing Liger-Kernel, and a model type or activation its kernels do not
    compute, from the config (milliseconds, no weights); a config that cannot be read is left to
    `apply_kernels` after the load."""
    if kernels == "none":
        return
    require_liger(kernels)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return
    problems = kernel_problems(
        kernels, getattr(config, "model_type", None), getattr(config, "hidden_act", None)
    )
    if problems:
        raise ConfigError(problems)


def check_heads_before_load(path: str, sp: int, trust_remote_code: bool) -> None:
    """`distributed.sequence_parallel`: refuse a model whose attention / key-value head counts cannot be
    split over `sp` ranks (`sequence_parallel.head_count_problem`), from its config alone (no weights)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    heads = int(config.num_attention_heads)
    problem = head_count_problem(heads, int(getattr(config, "num_key_value_heads", None) or heads), sp)
    if problem is not None:
        raise ConfigError([problem])


def check_lora_targets_before_load(path: str, spec: AdapterSpec) -> None:
    """`lora.check_model_targets` on a meta-device build of the model at `path` (milliseconds, no weights):
    meaning words mapped for the model's family, and every name checked to exist, before the load.

    Best effort: an architecture that cannot be built from its config alone (custom code) is checked by
    `apply_lora` after the load instead.
    """
    from zerofit.models.meta import build_meta_model

    try:
        meta = build_meta_model(path, attn_implementation="eager")  # names only: any attention will do
    except (ConfigError, ValueError, KeyError, ImportError):
        return
    check_model_targets(meta, spec)


def lora_spec(cfg: ZerofitConfig) -> AdapterSpec:
    """The adapter settings of `cfg.lora` (`zerofit.models.lora.lora_config`)."""
    lora = cfg.lora
    return lora_config(
        lora.r,
        lora.alpha,
        lora.dropout,
        lora.target_modules,
        lora.use_dora,
        lora.moe_experts,
        lora.train_router,
    )


def prepare_kbit_base(model: torch.nn.Module, *, fp32_residual: bool) -> torch.nn.Module:
    """Freeze a k-bit (QLoRA / 8-bit) base before adapters are added; `quantization.fp32_residual`.

    true: peft's `prepare_model_for_kbit_training`, which also upcasts every half-precision parameter that
    is not quantized (norms, embeddings, lm_head) to fp32, so the residual stream (embedding output, norm
    weights, bitsandbytes layers returning their input's dtype) runs in fp32. false: only the freeze; those
    parameters stay in the compute dtype and the residual stream is bf16/fp16 (half its bytes per token:
    what a checkpointed layer keeps). Checkpointing is left to `enable_activation_checkpointing`.
    """
    if fp32_residual:
        from peft import prepare_model_for_kbit_training

        return prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=False, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    model.requires_grad_(False)
    return model


def attention_path(cfg: ZerofitConfig) -> str:
    """`model.attn_implementation` as the model loads it: `auto` (a config that did not come through
    `resolve()`) as `resolve()` decides it (`attention_choice`: varlen, sdpa for remote code)."""
    return attention_choice(cfg)


def varlen_kernel(cfg: ZerofitConfig) -> str | None:
    """The kernel a varlen run uses on this process's device (CUDA when there is one, as the strategies
    place the model) in the run's compute dtype; None for sdpa / eager. An explicit `model.varlen_kernel`
    the device cannot run is refused here, before any weights load."""
    if attention_path(cfg) != "varlen":
        return None
    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    device = "cuda" if cuda else "cpu"
    dtype = torch_dtype(cfg.train.precision)
    return choose_kernel(cfg.model.varlen_kernel, device, dtype, capability, installed_kernels())


def check_memory_levers(cfg: ZerofitConfig) -> None:
    """Refuse lever settings the model cannot run, before any weights load: an `auto` that `resolve()`
    did not decide (this config did not come through it) and offload without checkpointing."""
    t = cfg.train
    tiled_mlp_shards(t.tiled_mlp)
    for key, value, example in (
        (
            "activation_offload",
            t.activation_offload,
            "train.activation_offload=true (with activation checkpointing)",
        ),
        ("lean_norm", t.lean_norm, "train.lean_norm=true"),
        ("cross_entropy", t.cross_entropy, "train.cross_entropy=chunked"),
    ):
        if value == "auto":
            raise ConfigError(
                [
                    f"train.{key} = 'auto' reached the model unresolved: the planner decides it in "
                    "resolve() (zerofit plan / a launch); outside them it must be true or false, e.g. "
                    f"{example}."
                ]
            )
    problems: list[str] = []
    check_levers(problems, cfg)  # resolve()'s own rule: offload needs checkpointing
    if problems:
        raise ConfigError(problems)


def check_fused_head_targets(cross_entropy: str, target_modules: str | list[str]) -> None:
    """`train.cross_entropy=fused_linear` with LoRA on lm_head is refused before the load (the fused loss
    needs lm_head a plain Linear; `install_fused_head` checks the loaded module itself too)."""
    if cross_entropy != FUSED_LINEAR or isinstance(target_modules, str):
        return
    if any(t == "lm_head" or t.endswith(".lm_head") for t in target_modules):
        raise ConfigError(
            [
                f"train.cross_entropy = 'fused_linear' with lora.target_modules = {list(target_modules)!r}: "
                "the fused loss runs inside lm_head and needs it a plain Linear layer, not a LoRA-adapted "
                "one; leave lm_head out of lora.target_modules, or use train.cross_entropy=chunked"
            ]
        )


def enable_memory_levers(hf: torch.nn.Module, cfg: ZerofitConfig) -> ActivationOffload | None:
    """Activation checkpointing of the first n decoder layers, activation offload of their saved inputs,
    the tiled MLP and the lean RMSNorms, as `train` asks (checked by `check_memory_levers`); returns the offload hooks (None
    when off).

    Non-reentrant checkpointing (`zerofit.levers.recompute`): the reentrant variant needs inputs that require
    grad and breaks with frozen embeddings (transformers 5 makes the embedding output require grad itself).
    """
    t = cfg.train
    layers = decoder_layers(hf)
    # A vision-language model's blocks: its vision blocks, then its decoder layers (`decoder_layers`).
    total = len(layers) if is_vision_config(hf.config.to_dict()) else hf.config.num_hidden_layers
    n_ckpt = enable_activation_checkpointing(hf, checkpointed_layers(t.activation_checkpointing, total))
    enable_tiled_mlp(layers, tiled_mlp_shards(t.tiled_mlp))
    if t.lean_norm is True:
        enable_lean_norm(hf)
    return enable_activation_offload(layers[:n_ckpt]) if t.activation_offload is True else None


def _check_before_load(cfg: ZerofitConfig, path: str) -> AdapterSpec:
    """Refuse what the model at `path` cannot run before its weights load (attention, lean norms, kernels,
    the heads sequence parallelism splits, LoRA targets), and return the LoRA spec.

    LoRA targets are checked against a meta-device build of the config (every module name, no weights), so
    a misspelled `lora.target_modules` entry is refused before a 7B load, not after it.
    """
    check_attention_before_load(path, attention_choice(cfg))
    if cfg.train.lean_norm is True:
        check_lean_norm_before_load(path)
    check_kernels_before_load(path, cfg.train.kernels)
    if cfg.distributed.sequence_parallel > 1:
        check_heads_before_load(path, cfg.distributed.sequence_parallel, cfg.model.trust_remote_code)
    spec = lora_spec(cfg)
    if cfg.lora.enabled:
        check_lora_targets_before_load(path, spec)
        check_fused_head_targets(cfg.train.cross_entropy, cfg.lora.target_modules)
    return spec


def _install_levers(
    hf: torch.nn.Module, cfg: ZerofitConfig, kernel: str | None
) -> tuple[ActivationOffload | None, int]:
    """Install the levers on the Hugging Face model `hf` (underneath peft), in the order each needs;
    returns the activation offload (`enable_memory_levers`) and how many layers were compiled."""
    # 4b. train.kernels=liger: Liger's RMSNorm, SwiGLU and RoPE forwards, before the tiled MLP wraps the
    #     MLP's forward (`zerofit.levers.kernels`).
    apply_kernels(hf, cfg.train.kernels)

    # 5. Memory levers: activation checkpointing of the first n decoder layers, offload of their saved
    #    inputs, the tiled MLP, lean RMSNorms (`enable_memory_levers`).
    offload = enable_memory_levers(hf, cfg)

    # 5b. train.cross_entropy=fused_linear: lm_head computes the loss itself inside the train step's
    #     context (`zerofit.token_loss.fused`), the same module and parameter names, logits everywhere else.
    if cfg.train.cross_entropy == FUSED_LINEAR and not is_reward_model(cfg):
        install_fused_head(hf)

    # 5c. model.attn_implementation=varlen: each attention module runs the kernel chosen for this device.
    if kernel is not None:
        install_kernel(hf, kernel)
    # 5d. train.compile: each decoder layer compiled in place, as every lever left it; checkpointing and the
    #     offload hooks stay outside the compiled body (`zerofit.levers.compiling`).
    compiled = compile_decoder_layers(decoder_layers(hf)) if cfg.train.compile else 0
    return offload, compiled


def _from_pretrained(cfg: ZerofitConfig, path: str, dtype: Any, quant: Any, device_map: Any) -> Any:
    """The transformers model at `path`, loaded in `dtype` (quantized by `quant`, placed by `device_map`),
    with the attention path the config chose; a hub failure is one paragraph (`hub_errors`). A reward model
    is the family's sequence classifier with a seeded score head (`zerofit.models.heads`); a vision-language
    model loads whole (vision tower, projector, language model)."""
    safe = safetensors_only(path, f"model.name_or_path {cfg.model.name_or_path}")  # never a pickle
    if quant is not None:  # before transformers' quantizer imports it: without its Hub-kernel message
        import_bitsandbytes()
    with hub_errors(cfg.model.name_or_path, "weights", path), seeded_head(cfg):
        return auto_model_class(cfg, path).from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=hf_attn_implementation(attention_path(cfg)),
            quantization_config=quant,
            trust_remote_code=cfg.model.trust_remote_code,
            device_map=device_map,
            **hub_kernels_off(),  # `train.kernels` alone decides the kernels (`zerofit.levers.kernels`)
            **head_kwargs(cfg),
            **safe,
        )


def build_model(cfg: ZerofitConfig, *, device_map: Any = None, tokenizer: Any = None) -> BuiltModel:
    """Load and adapt the model described by `cfg`, ready for a strategy to wrap.

    `device_map` is passed to `from_pretrained` (e.g. `{"": local_rank}` to place quantized weights on a
    GPU at load time); None keeps everything on CPU, which the engines then move. `tokenizer`: one already
    loaded with `load_tokenizer` (else it is loaded here).
    """
    # 1. Where the weights are (a built-in tiny model: written once as an HF folder); what cannot run is
    #    refused before anything loads.
    check_memory_levers(cfg)
    kernel = varlen_kernel(cfg)
    path = resolve_model_path(cfg)
    spec = _check_before_load(cfg, path)

    # 2. Load with the dtype rule (see `load_dtype`) and, for QLoRA / 8-bit, bitsandbytes quantization.
    dtype = load_dtype(cfg)
    quant = quantization_config(cfg)
    model = _from_pretrained(cfg, path, dtype, quant, device_map)

    # 3. Quantized base: freeze it and, with `quantization.fp32_residual` (default), upcast the non-quantized
    #    parts (norms, embeddings, lm_head) to fp32 for stable training (`prepare_kbit_base`).
    if quant is not None:
        model = prepare_kbit_base(model, fp32_residual=cfg.quantization.fp32_residual)

    # 4. LoRA adapters (peft): the base is frozen, only adapter weights train; they stay fp32 when the
    #    base is half precision (peft's `autocast_adapter_dtype=True` default).
    adapters = None
    if is_vision_config(model.config.to_dict()):  # the vision tower runs in every forward (sharded engines)
        run_vision_every_step(model)
    if cfg.lora.enabled and is_vision_config(model.config.to_dict()):  # language model only by default
        model, adapters = apply_vision_lora(model, spec, cfg.lora.projector, cfg.lora.vision_tower, cfg.seed)
    elif cfg.lora.enabled:
        targets = model_targets(model, spec)
        model = apply_lora(model, spec, seed=cfg.seed)
        adapters = f"{targets.summary or 'the listed modules'}: {adapted_counts(model).describe()}"

    # 4b-5d. Kernels, memory levers, the fused head, the varlen kernel and compile (`_install_levers`).
    offload, compiled = _install_levers(_hf_model(model), cfg, kernel)

    # 6. No KV cache in training (it is useless there and conflicts with checkpointing); train mode so
    #    checkpointing and dropout are active from the first step.
    _hf_model(model).config.use_cache = False
    model.train()

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    set_pad_token(cfg, model, tokenizer)  # a reward model scores each row's last non-pad token

    total, trainable = count_parameters(model)
    return BuiltModel(
        model=model,
        tokenizer=tokenizer,
        total_params=total,
        trainable_params=trainable,
        load_dtype=dtype,
        activation_offload=offload,
        varlen_kernel=kernel,
        compiled_layers=compiled,
        adapters=adapters,
    )
