"""`zerofit generate` on a peft adapter folder from elsewhere (no zerofit config): peft loads the base its
adapter_config.json names, through transformers, with the Hub's kernelization off as every zerofit model load
(`zerofit.levers.kernels.hub_kernels_off`), and samples from base + adapter."""

from __future__ import annotations

from pathlib import Path

import torch

from config_helpers import config
from zerofit.export.generate import load_generator
from zerofit.models.build import build_model


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
