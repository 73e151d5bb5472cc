"""`zerofit generate`: sample from a trained run, an export or any model a run can take (a smoke check after
training, and its before/after comparison with the base model).

A run or a zerofit export encodes the prompt the way its training encoded prompts: with the tokenizer's chat
template (as one user turn, plus the generation prompt) when the run trained on chat messages
(`data.format: messages`), otherwise as bos + the prompt's tokens, exactly the prefix a `{"prompt",
"response"}` example puts before its response. Any other model (no zerofit config says how it trained) gets
its tokenizer's chat template when it has one (an instruct model answers a user turn), else bos + tokens.
Decoding is greedy unless a temperature is given; transformers' `generate` does the rest.

    a run directory   the trained model rebuilt from config.yaml + its newest weights (or `--step N`)
    an export         a merged or full model folder, or an adapter folder (its base from the export's
                      zerofit_export.json, else from adapter_config.json via peft), or a GGUF export (the
                      file its zerofit_export.json names, read back by transformers' GGUF reader)
    a model           what `model.name_or_path` takes: a built-in name (`tiny-llama`, `smollm2-135m-instruct`,
                      resolved as a run resolves it: `models.build.resolve_model_path`), a hub id (the local
                      cache, else the hub: `models.hub.hub_errors`), a local Hugging Face folder

A saved config is data: the `model.trust_remote_code` a run's config.yaml or an export's zerofit_export.json
records holds only with the user's own --trust-remote-code (`trained.model.settle_remote_code`); a model
named on the command line runs its own code only with that flag too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.catalogue.models import is_builtin_model
from zerofit.config.loader import validate_config
from zerofit.config.rules.model import model_path_problem
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError, DataError
from zerofit.core.run_layout import CONFIG_FILE, EXPORT_INFO
from zerofit.levers.kernels import hub_kernels_off
from zerofit.models.build import load_tokenizer, resolve_model_path
from zerofit.models.heads import refuse_reward_model
from zerofit.models.hub import hub_errors
from zerofit.models.lora import peft_without_bitsandbytes
from zerofit.models.pretrained import gguf_name_maps_once
from zerofit.models.safe_weights import ADAPTER_WEIGHTS, MODEL_WEIGHTS, check_zerofit_folder, safetensors_only
from zerofit.models.vision import folder_config, folder_model_class, is_vision_config
from zerofit.trained.model import load_base, load_trained, settle_remote_code

__all__ = ["Generator", "load_generator"]


@dataclass
class Generator:
    """A model ready to sample from, its tokenizer, and whether prompts are chat turns."""

    model: Any
    tokenizer: Any
    chat: bool
    device: torch.device
    model_path: str | None = None  # the model folder, for a vision-language model's image processor

    def prompt_ids(self, prompt: str) -> torch.Tensor:
        """The prompt as training encoded it (see the module docstring), a (1, n) tensor on the device."""
        tok = self.tokenizer
        if self.chat:
            if not getattr(tok, "chat_template", None):
                raise DataError(
                    "the run trained on chat messages (data.format: messages) but this tokenizer has no chat "
                    "template to format the prompt with; export the run again with zerofit (the export saves "
                    "the run's data.chat_template with the tokenizer)"
                )
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        else:
            bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
            ids = bos + tok.encode(prompt, add_special_tokens=False)
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def inputs(self, prompt: str, image: Path | None) -> dict[str, torch.Tensor]:
        """The model's inputs: the prompt alone, or with `image` as one user turn (a vision-language model)."""
        if image is None:
            ids = self.prompt_ids(prompt)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        from zerofit.data.vision import vision_prompt
        from zerofit.models.vision import load_vision_processor

        if self.model_path is None or not is_vision_config(folder_config(self.model_path)):
            raise ConfigError(
                ["--image: this model is a language model, which reads no images; drop --image"]
            )
        processor = load_vision_processor(self.model_path, self.tokenizer)
        return {k: v.to(self.device) for k, v in vision_prompt(processor, prompt, image).items()}

    def __call__(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
        image: Path | None = None,
    ) -> str:
        """The model's continuation of `prompt` (after `image`, for a vision-language model; new tokens only,
        special tokens dropped)."""
        inputs = self.inputs(prompt, image)
        ids = inputs["input_ids"]
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(seed)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                use_cache=True,
                **sampling,
            )
        return str(self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def _device() -> tuple[torch.device, torch.dtype]:
    """The first GPU in bf16 (fp16 where bf16 is missing), else the CPU in fp32."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0), torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.device("cpu"), torch.float32


def _is_chat(config: dict[str, Any] | None, tokenizer: Any) -> bool:
    """Whether prompts are chat turns: as a zerofit `config` trained (`data.format: messages`); without one
    (a model from elsewhere), whenever the tokenizer has a chat template."""
    if config is None:
        return bool(getattr(tokenizer, "chat_template", None))
    data = config.get("data")
    return isinstance(data, dict) and data.get("format") == "messages"


def _from_export(
    folder: Path, device: torch.device, dtype: torch.dtype, trust_remote_code: bool
) -> Generator:
    """A Generator for an export folder: its `zerofit_export.json` config rebuilds an adapter's base as the run
    loaded it; that config's `model.trust_remote_code` holds only with `trust_remote_code` (the user's flag),
    and a folder from elsewhere (no such config) runs its own code only with the flag."""
    info_file = folder / EXPORT_INFO
    if info_file.is_file():  # zerofit wrote it: no pickle belongs there (`models.safe_weights`)
        check_zerofit_folder(folder, "a zerofit export")
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    config = info.get("config") if isinstance(info.get("config"), dict) else None
    if info.get("kind") == "gguf" and isinstance(info.get("file"), str):
        return _from_gguf(folder, info["file"], config, device, dtype)
    settled = (
        settle_remote_code(validate_config(config), trust_remote_code, str(info_file), folder)
        if config is not None
        else None
    )
    trust = settled.model.trust_remote_code if settled is not None else trust_remote_code
    with hub_errors(str(folder), "weights"):
        model, tokenizer = _load_export(folder, settled, trust, device, dtype)
    model = model.to(device=device, dtype=dtype).eval()
    return Generator(model, tokenizer, _is_chat(config, tokenizer), device, str(folder))


def _load_export(
    folder: Path, config: ZerofitConfig | None, trust: bool, device: torch.device, dtype: torch.dtype
) -> tuple[Any, Any]:
    """The model and tokenizer of an export folder (a merged / full model, or an adapter on its base), from
    safetensors only (`models.safe_weights`: a folder that would load a pickle is refused first)."""
    from transformers import AutoTokenizer

    adapter = (folder / "adapter_config.json").is_file()
    safe = safetensors_only(folder, str(folder), ADAPTER_WEIGHTS if adapter else MODEL_WEIGHTS)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if adapter:
        # the base exactly as the run loaded it (tiny-llama rebuilt, QLoRA dequantized)
        base = load_base(config, dtype, device) if config is not None else None
        with peft_without_bitsandbytes() as peft:
            if base is not None:
                return peft.PeftModel.from_pretrained(base, str(folder), is_trainable=False), tokenizer
        # a peft folder from elsewhere: its adapter_config.json names the base (which may load quantized)
        # (peft hands the keywords on to the base's `from_pretrained`)
        return peft.AutoPeftModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, trust_remote_code=trust, **hub_kernels_off(), **_peft_base_safe(folder)
        ), tokenizer
    auto = folder_model_class(folder)  # image-text-to-text for a vision-language model
    model = auto.from_pretrained(
        str(folder), dtype=dtype, trust_remote_code=trust, **hub_kernels_off(), **safe
    )
    return model, tokenizer


def _peft_base_safe(folder: Path) -> dict[str, Any]:
    """`safetensors_only` for the base a peft folder from elsewhere names in its adapter_config.json (a local
    folder holding only pickles is refused; a hub id is left to transformers)."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))[
            "base_model_name_or_path"
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # peft reports an adapter_config.json it cannot read
    if not isinstance(base, str) or not base:
        return {}
    return safetensors_only(base, f"{folder}/adapter_config.json base_model_name_or_path {base}")


def _from_gguf(
    folder: Path, name: str, config: dict[str, Any] | None, device: torch.device, dtype: torch.dtype
) -> Generator:
    """A GGUF export, dequantized by transformers' GGUF reader (a check of the file, not a fast runtime)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / name).is_file():
        raise ConfigError([f"{folder / name} is missing (its {EXPORT_INFO} names it); export again"])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with gguf_name_maps_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, **hub_kernels_off())
    return Generator(model.to(device=device).eval(), tokenizer, _is_chat(config, tokenizer), device)


def _from_model(name: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool) -> Generator:
    """A Generator for a model as a run names it (`model.name_or_path`, see the module docstring), untrained:
    resolved and its tokenizer loaded as a run does (a built-in built or converted once into the cache), the
    weights in `dtype`; its own code runs only with `trust_remote_code` (the user's --trust-remote-code)."""
    problem = model_path_problem(name)
    if problem is not None:
        raise ConfigError([problem])
    cfg = validate_config({"model": {"name_or_path": name, "trust_remote_code": trust_remote_code}})
    path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg)  # a hub id not here is said at once (`check_hub_id`), with the known ones
    with hub_errors(name, "weights", path):
        model = folder_model_class(path).from_pretrained(
            path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **hub_kernels_off(),
            **safetensors_only(path, name),
        )
    return Generator(model.to(device=device).eval(), tokenizer, _is_chat(None, tokenizer), device, path)


def _missing_folder(path: Path) -> bool:
    """True for a path that names a folder here that does not exist (`runs/one` where `runs/` exists), not a
    hub id: `owner/name` is read as a hub id only when no local folder `owner` exists."""
    return (
        not path.exists()
        and not is_builtin_model(str(path))
        and str(path.parent) != "."
        and path.parent.is_dir()
    )


def load_generator(
    path: Path | str, step: int | None = None, trust_pickles: bool = False, trust_remote_code: bool = False
) -> Generator:
    """A `Generator` for run directory, export or model `path` (see the module docstring); `trust_pickles` and
    `trust_remote_code` as for `zerofit.trained.load_trained` (a saved config's `model.trust_remote_code` holds
    only with `trust_remote_code`, the user's --trust-remote-code)."""
    name, path = str(path), Path(path)  # the name as typed (`./x` stays a path), for a model
    device, dtype = _device()
    if (path / CONFIG_FILE).is_file():
        trained = load_trained(
            path,
            step=step,
            dtype=dtype,
            device=device,
            trust_pickles=trust_pickles,
            trust_remote_code=trust_remote_code,
        )
        refuse_reward_model(trained.run.config, path, "generation")
        model_path = resolve_model_path(trained.run.config)
        return Generator(trained.model, trained.tokenizer, trained.run.is_chat, device, model_path)
    if step is not None:
        raise ConfigError(
            [
                f"--step {step}: {path} is not a run directory (no {CONFIG_FILE}), so it has one set of weights; "
                "--step picks a checkpoint of a run directory"
            ]
        )
    if any((path / file).is_file() for file in (EXPORT_INFO, "adapter_config.json")):
        return _from_export(path, device, dtype, trust_remote_code)
    if _missing_folder(path) or (path.is_dir() and not (path / "config.json").is_file()):
        raise ConfigError(
            [
                f"{path} is neither a run directory (it has no {CONFIG_FILE}), an export (no {EXPORT_INFO} or "
                "adapter_config.json) nor a model folder (no config.json); pass runs/<run_name>, a folder written "
                "by `zerofit export`, or a model as model.name_or_path takes it (a built-in such as "
                "smollm2-135m-instruct, a hub id, a local Hugging Face folder)"
            ]
        )
    return _from_model(name, device, dtype, trust_remote_code)
