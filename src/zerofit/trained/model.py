"""Rebuild a run's trained model in memory, from its `config.yaml` and its weights (any engine, any source).

    base model as the run loaded it (same path, dtype, quantization) -> dequantized (QLoRA / 8-bit)
    -> LoRA adapters from the final `adapter/` folder or a checkpoint's trainable tensors
       (or, for full fine-tuning, the whole model from `model/` or a checkpoint) -> eval mode, one dtype

`zerofit export` merges or saves what this returns; `zerofit generate` samples from it. The base is loaded
exactly as training loaded it, so a quantized base dequantizes to the very weights the adapters were
trained against (bitsandbytes' own dequantization, through transformers' `dequantize()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.config.loader import read_config_file, validate_config
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import ADAPTER_DIR, CONFIG_FILE, MODEL_DIR
from zerofit.data.chat import template_file
from zerofit.levers.kernels import hub_kernels_off
from zerofit.models.build import (
    load_dtype,
    load_tokenizer,
    lora_spec,
    quantization_config,
    resolve_model_path,
)
from zerofit.models.heads import auto_model_class, head_kwargs, set_pad_token
from zerofit.models.hub import allowed_remote_code, hub_errors
from zerofit.models.lora import apply_lora, peft_without_bitsandbytes
from zerofit.models.safe_weights import safetensors_only
from zerofit.models.vision import apply_vision_lora, is_vision_config
from zerofit.trained.checkpoints import CheckpointVanishedError, WeightsSource, find_weights, read_checkpoint

__all__ = [
    "RunConfig",
    "TrainedModel",
    "build_trained",
    "load_base",
    "load_trained",
    "read_run_config",
    "settle_remote_code",
    "tokenizer_for",
    "with_run_adapters",
]


@dataclass(frozen=True)
class RunConfig:
    """A run directory's resolved config: validated, plus the raw mapping (keys read tolerantly, such as
    `data.format`, which a config written by another zerofit version may or may not have)."""

    run_dir: Path
    config: ZerofitConfig
    raw: dict[str, Any]

    def data_value(self, key: str) -> Any:
        """`data.<key>` as the run recorded it, or None when the run's config has no such key."""
        data = self.raw.get("data")
        return data.get(key) if isinstance(data, dict) else None

    @property
    def is_chat(self) -> bool:
        """True when the run trained on chat messages (`data.format: messages`): prompts get the template."""
        return self.data_value("format") == "messages"


def settle_remote_code(config: ZerofitConfig, flag: bool, where: str, *folders: Path) -> ZerofitConfig:
    """`config` (read from a run or export folder, `where`) with `model.trust_remote_code` as the user allows
    it: on only with `flag` (--trust-remote-code); a base model (or one of `folders`) that would run code
    without it is refused (`hub.allowed_remote_code`). Every load downstream reads the settled value."""
    saved = config.model.trust_remote_code
    candidates = [*map(str, folders), resolve_model_path(config)] if saved and not flag else []
    allowed = allowed_remote_code(saved, flag, candidates, where)
    if allowed == saved:
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"trust_remote_code": allowed})})


def read_run_config(run_dir: Path, trust_remote_code: bool = False) -> RunConfig:
    """The `config.yaml` of run directory `run_dir`; `ConfigError` when it is missing or unreadable.
    `model.trust_remote_code` from it holds only with `trust_remote_code` (`settle_remote_code`)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            [
                f"{run_dir} is not a zerofit run directory (it has no {CONFIG_FILE}); pass runs/<run_name>, the "
                "folder a run printed as `results:`"
            ]
        )
    raw = read_config_file(path)  # UTF-8, a mapping, no alias bomb: a run folder may be a stranger's
    try:
        config = validate_config(raw)
    except ConfigError as exc:
        raise ConfigError(
            [
                f"{path} (the config the run was trained with) does not validate with this zerofit: {p}"
                for p in exc.problems
            ]
        ) from None
    config = settle_remote_code(
        config, trust_remote_code, str(path), run_dir / ADAPTER_DIR, run_dir / MODEL_DIR
    )
    return RunConfig(run_dir, config, raw)


@dataclass
class TrainedModel:
    """A run's trained model, rebuilt: the peft model (LoRA) or the HF model (full), in eval mode."""

    model: torch.nn.Module
    tokenizer: Any
    run: RunConfig
    source: WeightsSource

    @property
    def is_lora(self) -> bool:
        """True when `model` is a peft model (adapters not merged)."""
        return hasattr(self.model, "peft_config")


def tokenizer_for(run: RunConfig, source: WeightsSource | None = None) -> Any:
    """The run's tokenizer: the one its final export saved (pad token settled), else the base model's; with
    the run's `data.chat_template` when it set one (training formatted its chats with that template)."""
    from transformers import AutoTokenizer

    folder = source.path if source is not None and source.kind != "checkpoint" else None
    saved = folder is not None and (folder / "tokenizer_config.json").is_file()
    if folder is not None and saved:
        with hub_errors(str(folder), "tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(
                folder, trust_remote_code=run.config.model.trust_remote_code
            )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = load_tokenizer(run.config)
    template = run.data_value("chat_template")
    if isinstance(template, str) and template:
        text = _template_text(run, template, saved and bool(getattr(tokenizer, "chat_template", None)))
        if text is not None:
            tokenizer.chat_template = text
    return tokenizer


def _template_text(run: RunConfig, value: str, tokenizer_has_it: bool) -> str | None:
    """The template text of the run's `data.chat_template` (Jinja text, or the path of a file holding it, by
    `data.chat_template`'s own rule); None: keep the saved tokenizer's template (training installed it).

    A saved config is data: a file it names is read only inside the run folder. A file elsewhere (where
    training read it) is not read again; the run's final export carries the text in its tokenizer, and a
    checkpoint, which has no tokenizer, is refused with the fix rather than exported without its template.
    """
    path = template_file(value)
    if path is None:
        return value
    try:
        inside = (run.run_dir / path).resolve()
        readable = inside.is_relative_to(run.run_dir.resolve()) and inside.is_file()
    except (OSError, ValueError):  # no valid file name (too long, NUL bytes)
        readable = False
    if readable:
        return inside.read_text(encoding="utf-8")
    if tokenizer_has_it:
        return None
    raise ConfigError(
        [
            f"{run.run_dir / CONFIG_FILE}: data.chat_template = {value!r} names a file outside the run folder, "
            "and zerofit reads no file outside a run folder on its saved config's word (the weights come from a "
            "checkpoint, whose tokenizer holds no template). If it is your run, copy the template into the run "
            f"folder and name it there (data.chat_template: chat.jinja for {run.run_dir}/chat.jinja), or put "
            "the template text itself in data.chat_template"
        ]
    )


def load_base(cfg: ZerofitConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """The base model as the run loaded it, dequantized when it was quantized, in `dtype` on `device` (a
    reward model's: its sequence classifier, `zerofit.models.heads`, the trained score head loaded over it)."""
    quant = quantization_config(cfg)
    path = resolve_model_path(cfg)
    safe = safetensors_only(path, f"model.name_or_path {cfg.model.name_or_path}")  # never a pickle
    with hub_errors(cfg.model.name_or_path, "weights", path):
        model = auto_model_class(cfg, path).from_pretrained(
            path,
            dtype=load_dtype(cfg),
            # The merge never runs attention; the exported config names transformers' own sdpa, not
            # zerofit's varlen function (a reader without zerofit loads it).
            attn_implementation="eager" if cfg.model.attn_implementation == "eager" else "sdpa",
            quantization_config=quant,
            trust_remote_code=cfg.model.trust_remote_code,
            device_map={"": str(device)} if quant is not None else None,
            **hub_kernels_off(),
            **head_kwargs(cfg),
            **safe,
        )
    if quant is not None:
        # QLoRA / 8-bit: the adapters were trained against these quantized weights; bitsandbytes'
        # dequantization gives exactly the values its matmuls used.
        model = model.dequantize()
    return model.to(device=device, dtype=dtype)


def with_run_adapters(base: torch.nn.Module, cfg: ZerofitConfig) -> torch.nn.Module:
    """`base` wrapped in fresh peft LoRA adapters where the run's training put them: a vision-language
    model's by its family (`models.vision`: the language model, `lora.projector`, `lora.vision_tower`), any
    other model's by `lora.target_modules`. Shared by the merge and a checkpoint's adapter export."""
    if is_vision_config(base.config.to_dict()):
        model, _ = apply_vision_lora(base, lora_spec(cfg), cfg.lora.projector, cfg.lora.vision_tower, None)
        return model
    return apply_lora(base, lora_spec(cfg))


def _apply_adapters(
    base: torch.nn.Module, run: RunConfig, source: WeightsSource, dtype: torch.dtype
) -> torch.nn.Module:
    """LoRA adapters of `source` on `base`: peft loads an adapter folder; a checkpoint's tensors go into a
    fresh peft wrapper of the run's own LoRA config."""
    if source.kind == "adapter":
        with peft_without_bitsandbytes() as peft:
            return peft.PeftModel.from_pretrained(base, str(source.path), is_trainable=False).to(dtype)
    if source.kind == "model":
        raise ConfigError(
            [f"{source.path} is a full model export, but {run.run_dir}/config.yaml says lora.enabled=true"]
        )
    model = with_run_adapters(base, run.config)
    _load_trainable(model, read_checkpoint(source.path, source.trust_pickles), run, source)
    return model.to(dtype)


def _load_trainable(
    model: torch.nn.Module, state: dict[str, torch.Tensor], run: RunConfig, source: WeightsSource
) -> None:
    """Copy a checkpoint's trainable tensors into `model`: every tensor must land, and every trainable weight
    must be in the checkpoint (a mismatch means the run's config and its checkpoint disagree)."""
    result = model.load_state_dict(state, strict=False)
    loaded = {id(p) for name, p in model.named_parameters() if name in state}
    lacking = [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.requires_grad and name not in state and id(p) not in loaded  # a tied weight loads with its twin
    ]
    if result.unexpected_keys or lacking:
        detail = (
            f"tensors with no place in the model: {result.unexpected_keys[:3]}"
            if result.unexpected_keys
            else f"trainable weights the checkpoint lacks: {lacking[:3]}"
        )
        raise ConfigError(
            [
                f"{source.describe()} of {run.run_dir} does not fit the model its {CONFIG_FILE} describes "
                f"({detail}); was {CONFIG_FILE} edited after the run? Restore it, or export another run"
            ]
        )


def build_trained(
    run: RunConfig,
    source: WeightsSource,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> TrainedModel:
    """Rebuild the model `run` trained, with the weights of `source`, in `dtype` on `device`."""
    cfg = run.config
    if cfg.lora.enabled:
        model = _apply_adapters(load_base(cfg, dtype, device), run, source, dtype)
    elif source.kind == "model":
        model = (
            auto_model_class(cfg, source.path)
            .from_pretrained(str(source.path), dtype=dtype, use_safetensors=True, **hub_kernels_off())
            .to(device)
        )
    elif source.kind == "adapter":
        raise ConfigError(
            [f"{source.path} is a LoRA adapter, but {run.run_dir}/{CONFIG_FILE} says lora.enabled=false"]
        )
    else:
        model = load_base(cfg, torch.float32, device)
        _load_trainable(model, read_checkpoint(source.path, source.trust_pickles), run, source)
        model = model.to(dtype)
    model.eval()
    tokenizer = tokenizer_for(run, source)
    set_pad_token(cfg, model, tokenizer)  # a reward model pools at the last non-pad token
    return TrainedModel(model=model, tokenizer=tokenizer, run=run, source=source)


def load_trained(
    run_dir: Path,
    *,
    step: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_pickles: bool = False,
    trust_remote_code: bool = False,
) -> TrainedModel:
    """The trained model of `run_dir`, with the weights `find_weights(run_dir, step)` picks (`trust_pickles`:
    let DeepSpeed / DCP unpickle a checkpoint that names globals beyond zerofit's allow-list;
    `trust_remote_code`: honour the run's `model.trust_remote_code`, see `settle_remote_code`)."""
    run = read_run_config(run_dir, trust_remote_code)
    source = find_weights(run.run_dir, step, trust_pickles)
    try:
        return build_trained(run, source, dtype=dtype, device=device)
    except CheckpointVanishedError:
        if step is not None:
            raise  # that checkpoint is gone: the message says so
        # The newest checkpoint was pruned between picking and reading it: a running training saved a newer
        # one, which is now the newest weights.
        return build_trained(run, find_weights(run.run_dir, None, trust_pickles), dtype=dtype, device=device)
