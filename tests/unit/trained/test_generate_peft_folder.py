"""`zerofit generate` on a peft adapter folder from elsewhere (no zerofit config): peft loads the base its
adapter_config.json names, through transformers, with the Hub's kernelization off as every zerofit model load
(`zerofit.levers.kernels.hub_kernels_off`), and samples from base + adapter; one whose adapter is a pickle
(`adapter_model.bin`, no safetensors) is refused before peft would unpickle it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from planted_pickle import plant_pickle

from config_helpers import config
from zerofit.core.errors import ConfigError
from zerofit.models.build import build_model
from zerofit.trained.generate import load_generator


def test_a_peft_folder_from_elsewhere_loads_its_base_without_hub_kernels(tmp_path: Path) -> None:
    cfg = config({"seed": 0, "lora": {"enabled": True}}, train={"precision": "fp32"})
    built = build_model(cfg)
    folder = tmp_path / "adapter"
    built.model.save_pretrained(str(folder))  # adapter_config.json names the base by its folder
    built.tokenizer.save_pretrained(str(folder))
    assert (folder / "adapter_config.json").is_file()

    gen = load_generator(folder)
    base = gen.model.get_base_model()
    assert not getattr(base, "use_kernels", False)
    lora = {n: p for n, p in gen.model.named_parameters() if "lora_" in n}
    trained = {n: p for n, p in built.model.named_parameters() if "lora_" in n}
    assert lora.keys() == trained.keys() and lora
    for name, param in lora.items():
        assert torch.equal(param.cpu(), trained[name].detach().cpu()), name


def test_a_peft_folder_from_elsewhere_with_pickled_weights_is_refused(tmp_path: Path) -> None:
    cfg = config({"seed": 0, "lora": {"enabled": True}}, train={"precision": "fp32"})
    built = build_model(cfg)
    folder, ran = tmp_path / "adapter", tmp_path / "ran"
    built.model.save_pretrained(str(folder))
    built.tokenizer.save_pretrained(str(folder))
    (folder / "adapter_model.safetensors").unlink()
    plant_pickle(folder / "adapter_model.bin", ran)
    with pytest.raises(ConfigError) as err:
        load_generator(folder)
    text = err.value.without_heading()
    assert f"{folder}: it holds only pickled weights (adapter_model.bin) and no safetensors" in text
    assert "\n" not in text and not ran.exists()
