"""On-policy distillation's teacher (`gkd.teacher`): any model zerofit can load, frozen on the rank's device.

The teacher is loaded as `zerofit generate` loads a model (`zerofit.trained.generate.load_generator`: a built-in,
a hub id, a model folder, a zerofit run folder rebuilt from its config and weights, or an export), then checked
to share the student's tokenizer (the loss compares the two distributions token id by token id: a different
vocabulary is refused in one paragraph naming both), moved to the rank's device in the student's load dtype,
put in eval mode with every parameter's gradient off. With `gkd.teacher_load_in` 8bit / 4bit, a model folder
(a built-in, a hub id, a merged export) loads its linear weights quantized by bitsandbytes, on CUDA only.
Every rank holds a whole teacher (it has no optimizer state to shard); `zerofit plan` counts it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError, LaunchError
from zerofit.core.run_layout import CONFIG_FILE
from zerofit.levers.kernels import hub_kernels_off
from zerofit.models.build import load_dtype, load_tokenizer, resolve_model_path
from zerofit.models.safe_weights import safetensors_only
from zerofit.trained.generate import load_generator

__all__ = ["load_teacher", "vocabulary_problem"]


def _describe(tokenizer: Any, where: str) -> str:
    """A tokenizer's vocabulary in words: whose, its class and its size."""
    return f"{where} ({type(tokenizer).__name__}, {len(tokenizer):,} tokens)"


def vocabulary_problem(student: Any, teacher: Any, cfg: ZerofitConfig) -> str | None:
    """Why the teacher's tokenizer is not the student's (one paragraph naming both vocabularies), or None."""
    if student.get_vocab() == teacher.get_vocab():
        return None
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:1]
    example = (
        f" (e.g. token {differ[0][0]!r} is id {differ[0][1]} in one and not the other)" if differ else ""
    )
    return (
        f"gkd.teacher = {cfg.gkd.teacher!r} has another vocabulary than the student: the student's is "
        f"{_describe(student, f'model.name_or_path {cfg.model.name_or_path!r}')}, the teacher's "
        f"{_describe(teacher, f'gkd.teacher {cfg.gkd.teacher!r}')}{example}; distillation compares the two "
        "models' next-token distributions id by id, so they must share one tokenizer. Pick a teacher of the "
        "student's family (the same tokenizer), or a student of the teacher's."
    )


def _as_model(cfg: ZerofitConfig) -> ZerofitConfig:
    """`cfg` with the teacher as its model (how a run would load it: built-in, hub id or folder)."""
    model = cfg.model.model_copy(update={"name_or_path": cfg.gkd.teacher})
    return cfg.model_copy(update={"model": model})


def _quantized(cfg: ZerofitConfig, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The teacher's model folder with bitsandbytes' 8- or 4-bit linear weights on `device` (CUDA), and its
    tokenizer."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    g = cfg.gkd
    assert g.teacher is not None
    if device.type != "cuda":
        raise LaunchError(
            f"gkd.teacher_load_in = {g.teacher_load_in!r} quantizes the teacher with bitsandbytes on CUDA, and "
            f"this rank runs on {device}; set gkd.teacher_load_in=none, or run on a CUDA device"
        )
    if (Path(g.teacher) / CONFIG_FILE).is_file() or (Path(g.teacher) / "adapter_config.json").is_file():
        raise ConfigError([
            f"gkd.teacher_load_in = {g.teacher_load_in!r} loads a model folder quantized, and gkd.teacher = "
            f"{g.teacher!r} is a run or adapter folder (its weights are a base plus adapters); export it merged "
            "first (zerofit export <run> --merge) and name that folder, or set gkd.teacher_load_in=none"
        ])  # fmt: skip
    as_model = _as_model(cfg)
    path, dtype = resolve_model_path(as_model), load_dtype(cfg)
    bits = {"8bit": {"load_in_8bit": True}, "4bit": {"load_in_4bit": True, "bnb_4bit_compute_dtype": dtype}}
    model = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=BitsAndBytesConfig(**bits[g.teacher_load_in]),
        device_map={"": device.index or 0},
        dtype=dtype,
        **safetensors_only(path, g.teacher),
        **hub_kernels_off(),
    )
    return model, load_tokenizer(as_model)


def load_teacher(cfg: ZerofitConfig, tokenizer: Any, device: torch.device) -> torch.nn.Module:
    """`gkd.teacher` loaded, its vocabulary checked against the student's `tokenizer`, frozen on `device`."""
    assert cfg.gkd.teacher is not None, "resolve refuses gkd without a teacher"
    if cfg.gkd.teacher_load_in != "none":
        model, theirs = _quantized(cfg, device)
    else:
        loaded = load_generator(cfg.gkd.teacher, trust_remote_code=cfg.model.trust_remote_code)
        model, theirs = loaded.model.to(device=device, dtype=load_dtype(cfg)), loaded.tokenizer
    problem = vocabulary_problem(tokenizer, theirs, cfg)
    if problem is not None:
        raise ConfigError([problem])
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model
