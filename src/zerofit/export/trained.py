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
import yaml

from zerofit.config.loader import validate_config
from zerofit.config.schema import ZerofitConfig
from zerofit.errors import ConfigError
from zerofit.export.checkpoints import CheckpointVanishedError, WeightsSource, find_weights, read_checkpoint
from zerofit.hub import hub_errors
from zerofit.lora import apply_lora
from zerofit.model import load_dtype, load_tokenizer, lora_spec, quantization_config, resolve_model_path
from zerofit.run_layout import CONFIG_FILE

__all__ = [
    "RunConfig",
    "TrainedModel",
    "build_trained",
    "load_base",
    "load_trained",
    "read_run_config",
    "tokenizer_for",
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


def read_run_config(run_dir: Path) -> RunConfig:
    """The `config.yaml` of run directory `run_dir`; `ConfigError` when it is missing or unreadable."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            [
                f"{run_dir} is not a zerofit run directory (it has no {CONFIG_FILE}); pass runs/<run_name>, the "
                "folder a run printed as `results:`"
            ]
        )
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path} must hold a mapping of config keys, got {type(raw).__name__}"])
    try:
        config = validate_config(raw)
    except ConfigError as exc:
        raise ConfigError(
            [
                f"{path} (the config the run was trained with) does not validate with this zerofit: {p}"
                for p in exc.problems
            ]
        ) from None
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

    if (
        source is not None
        and source.kind != "checkpoint"
        and (source.path / "tokenizer_config.json").is_file()
    ):
        tokenizer = AutoTokenizer.from_pretrained(source.path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = load_tokenizer(run.config)
    template = run.data_value("chat_template")
    if isinstance(template, str) and template:
        tokenizer.chat_template = _template_text(template)
    return tokenizer


def _template_text(value: str) -> str:
    """`data.chat_template` is a Jinja template, or the path of a file holding one."""
    try:
        path = Path(value)
        return path.read_text() if path.is_file() else value
    except (OSError, ValueError):  # a template is no valid file name (too long, NUL bytes)
        return value


def load_base(cfg: ZerofitConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """The base model as the run loaded it, dequantized when it was quantized, in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    quant = quantization_config(cfg)
    with hub_errors(cfg.model.name_or_path, "weights"):
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model_path(cfg),
            dtype=load_dtype(cfg),
            # The merge never runs attention; the exported config names transformers' own sdpa, not
            # zerofit's varlen function (a reader without zerofit loads it).
            attn_implementation="eager" if cfg.model.attn_implementation == "eager" else "sdpa",
            quantization_config=quant,
            trust_remote_code=cfg.model.trust_remote_code,
            device_map={"": str(device)} if quant is not None else None,
        )
    if quant is not None:
        # QLoRA / 8-bit: the adapters were trained against these quantized weights; bitsandbytes'
        # dequantization gives exactly the values its matmuls used.
        model = model.dequantize()
    return model.to(device=device, dtype=dtype)


def _apply_adapters(
    base: torch.nn.Module, run: RunConfig, source: WeightsSource, dtype: torch.dtype
) -> torch.nn.Module:
    """LoRA adapters of `source` on `base`: peft loads an adapter folder; a checkpoint's tensors go into a
    fresh peft wrapper of the run's own LoRA config."""
    if source.kind == "adapter":
        from peft import PeftModel

        return PeftModel.from_pretrained(base, str(source.path), is_trainable=False).to(dtype)
    if source.kind == "model":
        raise ConfigError(
            [f"{source.path} is a full model export, but {run.run_dir}/config.yaml says lora.enabled=true"]
        )
    model = apply_lora(
        base,
        lora_spec(run.config),
    )
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
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype).to(device)
    elif source.kind == "adapter":
        raise ConfigError(
            [f"{source.path} is a LoRA adapter, but {run.run_dir}/{CONFIG_FILE} says lora.enabled=false"]
        )
    else:
        model = load_base(cfg, torch.float32, device)
        _load_trainable(model, read_checkpoint(source.path, source.trust_pickles), run, source)
        model = model.to(dtype)
    model.eval()
    return TrainedModel(model=model, tokenizer=tokenizer_for(run, source), run=run, source=source)


def load_trained(
    run_dir: Path,
    *,
    step: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_pickles: bool = False,
) -> TrainedModel:
    """The trained model of `run_dir`, with the weights `find_weights(run_dir, step)` picks (`trust_pickles`:
    let DeepSpeed / DCP unpickle a checkpoint that names globals beyond zerofit's allow-list)."""
    run = read_run_config(run_dir)
    source = find_weights(run.run_dir, step, trust_pickles)
    try:
        return build_trained(run, source, dtype=dtype, device=device)
    except CheckpointVanishedError:
        if step is not None:
            raise  # that checkpoint is gone: the message says so
        # The newest checkpoint was pruned between picking and reading it: a running training saved a newer
        # one, which is now the newest weights.
        return build_trained(run, find_weights(run.run_dir, None, trust_pickles), dtype=dtype, device=device)
