"""Config rules of the model and what runs it: the model path, quantization, attention, the loss implementation,
the opt-in kernels and the long-context levers, and how the model is adapted (`adaptation_method`)."""

from __future__ import annotations

from pathlib import Path

from zerofit.catalogue.models import is_builtin_model, soft_caps_attention
from zerofit.config.schema import ZerofitConfig


def adaptation_method(cfg: ZerofitConfig) -> str:
    """`full`, `lora`, `qlora` or `lora-8bit`: how the model is adapted, for names and tables."""
    if not cfg.lora.enabled:
        return "full"
    return {"none": "lora", "4bit": "qlora", "8bit": "lora-8bit"}[cfg.quantization.load_in]


def model_path_problem(name: str) -> str | None:
    """A `model.name_or_path` that is a path (or an existing folder) but no model folder, said with the fix.

    A name that is neither a path nor a folder here is a hub id: the hub says whether it exists (`models/hub.py`).
    """
    if is_builtin_model(name):
        return None
    folder = Path(name).expanduser()
    model_folder = "a model folder (config.json, the tokenizer files and the weights, as save_pretrained or `hf download` writes it)"
    if folder.is_dir():
        if (folder / "config.json").is_file():
            return None
        return (
            f"model.name_or_path = {name!r}: that folder has no config.json, so it is not {model_folder}; "
            "point it at the folder that holds config.json, or use a hub id such as meta-llama/Llama-2-7b-hf"
        )
    if name.startswith((".", "/", "~")):
        return (
            f"model.name_or_path = {name!r} is neither an existing folder nor a Hugging Face hub id (which "
            f"looks like org/name): fix the path to {model_folder}, or use a hub id such as "
            "meta-llama/Llama-2-7b-hf (or tiny-llama, the built-in test model)"
        )
    return None


def _liger_available() -> bool:
    """`zerofit.token_loss.sums.liger_available`, imported only when asked: `zerofit.token_loss.sums` imports torch, and resolving
    a config (`zerofit plan`, `import zerofit`) stays torch-free otherwise."""
    from zerofit.token_loss.sums import liger_available

    return liger_available()


def check_levers(problems: list[str], cfg: ZerofitConfig) -> None:
    """Activation offload moves the checkpointed layers' inputs to host memory, so it needs checkpointing
    (also applied by `zerofit.models.build` to a config that did not come through `resolve()`)."""
    t = cfg.train
    if t.activation_offload is True and t.activation_checkpointing in (False, 0):
        problems.append(
            f"train.activation_offload = true needs activation checkpointing (train.activation_checkpointing = "
            f"{t.activation_checkpointing!r} checkpoints no layer): it offloads the inputs checkpointed layers "
            "save, and without checkpointing every activation of every layer would cross PCIe twice a step. "
            "Set train.activation_checkpointing=true (or a number of layers, or auto), or "
            "train.activation_offload=false."
        )


def check_kernels(problems: list[str], cfg: ZerofitConfig) -> None:
    """`train.kernels=liger` needs Liger-Kernel installed, and replaces the RMSNorm forward the lean norm
    replaces too (the same saved tensors): the two are not combined (`auto` lean norm resolves to false)."""
    t = cfg.train
    if t.kernels == "none":
        return
    from zerofit.levers.kernels import LIGER_INSTALL, liger_kernels_available

    if not liger_kernels_available():
        problems.append(
            f"train.kernels = {t.kernels!r} needs Liger-Kernel, which is not installed here (its Triton kernels "
            f"run on CUDA only): {LIGER_INSTALL} on a CUDA machine, or train.kernels=none"
        )
    if t.lean_norm is True:
        problems.append(
            f"train.kernels = {t.kernels!r} with train.lean_norm = true: both replace the RMSNorm forward, and "
            "Liger's RMSNorm already saves only its input and the fp32 rstd (what the lean norm saves); set "
            "train.lean_norm=false (or auto)"
        )


def fill_kernels(cfg: ZerofitConfig) -> list[str]:
    """With `train.kernels=liger`, the lean norm's `auto` is false (Liger's RMSNorm saves the same), and an
    unset `train.cross_entropy` is Liger's fused linear cross-entropy (`fused_linear`, where lm_head has no
    LoRA adapter); returns the notes the plan prints."""
    t = cfg.train
    if t.kernels == "none":
        return []
    notes: list[str] = []
    if t.lean_norm == "auto":
        t.lean_norm = False
        notes.append(
            "train.lean_norm auto -> false: Liger's RMSNorm (train.kernels=liger) saves the same tensors"
        )
    targets = cfg.lora.target_modules if cfg.lora.enabled else "all-linear"
    lm_head_adapted = not isinstance(targets, str) and any(x.split(".")[-1] == "lm_head" for x in targets)
    if ("cross_entropy" not in t.model_fields_set or t.cross_entropy == "auto") and not lm_head_adapted:
        t.cross_entropy = "fused_linear"
        notes.append(
            "train.cross_entropy -> fused_linear: Liger's fused linear cross-entropy (train.kernels=liger; "
            "set train.cross_entropy to keep another)"
        )
    return notes


def check_quantization(problems: list[str], cfg: ZerofitConfig) -> None:
    """Quantized base weights are frozen, so they need LoRA, and 8-bit ones cannot be sharded by FSDP2."""
    load_in = cfg.quantization.load_in
    if load_in != "none" and not cfg.lora.enabled:
        problems.append(
            f"quantization.load_in = {load_in!r} freezes quantized base weights, so it needs "
            "LoRA: set lora.enabled=true (QLoRA) or quantization.load_in=none for full fine-tuning"
        )
    # Checked on 2 gloo ranks: 4-bit works under FSDP2 and ZeRO-3 (+offload), 8-bit under ZeRO-3, but
    # FSDP2 re-gathers 8-bit weights as plain tensors without their int8 state and the forward fails.
    if load_in == "8bit" and cfg.distributed.strategy == "fsdp":
        problems.append(
            "quantization.load_in = '8bit' with distributed.strategy = 'fsdp': FSDP2 re-gathers bitsandbytes "
            "8-bit weights as plain tensors without their int8 quantization state, so the forward fails; use "
            "quantization.load_in=4bit (QLoRA shards under FSDP2), or distributed.strategy=deepspeed (8-bit "
            "works with every ZeRO stage), ddp or single"
        )


def check_model_and_loss(problems: list[str], cfg: ZerofitConfig) -> None:
    """The model path names a model folder (or a hub id), and the chosen loss kernel is installed."""
    model_problem = model_path_problem(cfg.model.name_or_path)
    if model_problem is not None:
        problems.append(model_problem)
    if cfg.train.cross_entropy == "liger" and not _liger_available():
        problems.append(
            "train.cross_entropy = 'liger' needs Liger-Kernel, which is not installed here (it runs on CUDA "
            "only: pip install liger-kernel); use train.cross_entropy=chunked (the default: pure PyTorch, "
            "the same token sums, no full fp32 logits)"
        )


def check_attention(problems: list[str], cfg: ZerofitConfig) -> None:
    """An explicit `model.varlen_kernel` needs the varlen path, an install that has it and half precision
    (the device is checked when the model loads: `zerofit.levers.attention.choose_kernel`)."""
    import importlib.util

    m, precision = cfg.model, cfg.train.precision
    kernel = m.varlen_kernel
    if kernel == "auto":
        return
    if m.attn_implementation in ("sdpa", "eager"):
        problems.append(
            f"model.varlen_kernel = {kernel!r} with model.attn_implementation = {m.attn_implementation!r}: the "
            "kernel is the varlen path's; set model.attn_implementation=varlen (or auto), or model.varlen_kernel=auto"
        )
    module = {"flash_attn": "flash_attn", "torch_varlen": "torch.nn.attention.varlen"}.get(kernel)
    if module is not None and importlib.util.find_spec(module) is None:
        fix = "pip install flash-attn (CUDA)" if kernel == "flash_attn" else "a torch that has it (2.10+)"
        problems.append(
            f"model.varlen_kernel = {kernel!r}: {module} is not installed here; install it ({fix}) or set "
            "model.varlen_kernel=auto (the best kernel that runs: sdpa_per_document at worst, exact)"
        )
    elif module is not None and precision == "fp32":
        problems.append(
            f"model.varlen_kernel = {kernel!r} with train.precision = 'fp32': the kernel runs in bf16/fp16 "
            "only; set train.precision=bf16, or model.varlen_kernel=sdpa_per_document (or auto) for fp32"
        )


def fill_attention(cfg: ZerofitConfig) -> None:
    """Decide `model.attn_implementation: auto`: varlen (zerofit.levers.attention), whose mask hook runs
    transformers' plain sdpa (is_causal, no mask) for a micro-batch without documents (one unpadded
    sequence per row) and the documents without a dense (B, 1, S, S) mask where sdpa would build one, so the
    choice does not depend on the micro-batch the planner varies. Remote code (`model.trust_remote_code`)
    keeps sdpa: a custom model need not build its masks through transformers' mask interface. A model that
    soft-caps its attention logits (Gemma-2) gets eager, the only path that computes the cap."""
    cfg.model.attn_implementation = attention_choice(cfg)  # type: ignore[assignment]


def attention_choice(cfg: ZerofitConfig) -> str:
    """`model.attn_implementation` with `auto` decided (`fill_attention`'s rule; also applied by
    `zerofit.models.build` to a config that did not come through `resolve()`)."""
    m = cfg.model
    if m.attn_implementation != "auto":
        return m.attn_implementation
    if soft_caps_attention(m.name_or_path):
        return "eager"  # Gemma-2's attention-logit soft-capping: only transformers' eager path computes it
    return "sdpa" if m.trust_remote_code and m.varlen_kernel == "auto" else "varlen"
