"""A vision-language run's LoRA adapter exported from a mid-run checkpoint (`zerofit export RUN --step N`,
no --merge): the adapters sit where training put them (the language model's linears, not the
vision tower's), so the export of the last checkpoint is the run's own `adapter/`, tensor for tensor, and
an earlier step's export loads onto the base with peft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
WEIGHTS = "adapter_model.safetensors"


@pytest.mark.slow
def test_an_adapter_exports_from_a_mid_run_checkpoint_of_a_vision_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import peft
    import transformers

    import zerofit
    from zerofit.cli import main as cli
    from zerofit.models.tiny_vision import ensure_tiny_vlm

    zerofit.train(
        str(REPO / "configs" / "demo-vlm.yaml"),
        output_dir=str(tmp_path),
        run_name="vlm",
        data={"path": str(REPO / "data" / "demo-vlm.jsonl")},
        train={"max_steps": 4},
        checkpoint={"every_steps": 2},
        logging={"console": False, "wandb": {"mode": "disabled"}},
    )
    run = tmp_path / "vlm"
    for step in (2, 4):
        assert cli(["export", str(run), "--step", str(step), "--out", str(tmp_path / f"step{step}")]) == 0
    # peft has no Auto class for image-text-to-text: the hint loads the base through transformers.
    assert (
        "peft.PeftModel.from_pretrained(transformers.AutoModelForImageTextToText" in capsys.readouterr().out
    )
    final, last, mid = (load_file(folder / WEIGHTS) for folder in (run / "adapter", tmp_path / "step4",
                                                                   tmp_path / "step2"))  # fmt: skip
    assert sorted(last) == sorted(final) and not any("visual" in name for name in last)
    assert all(torch.equal(last[name], final[name]) for name in final)
    assert any(not torch.equal(mid[name], final[name]) for name in final)  # step 2's weights, not step 4's
    assert (tmp_path / "step2" / "preprocessor_config.json").is_file()
    base = transformers.AutoModelForImageTextToText.from_pretrained(str(ensure_tiny_vlm("tiny-qwen2-vl")))
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "step2"))
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(mid) and all(
        torch.equal(loaded[n.replace(".weight", ".default.weight")], t) for n, t in mid.items()
    )
