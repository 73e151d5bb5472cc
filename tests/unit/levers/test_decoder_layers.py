"""`zerofit.models.meta`: the one rule for a model's decoder layers, shared by the run (checkpointing,
tiling, compiling) and the planner (shapes, trace)."""

from __future__ import annotations

import ast
from pathlib import Path

from zerofit.levers.layers import decoder_layers, decoder_layers_prefix

SRC = Path(__file__).resolve().parents[3] / "src" / "zerofit"


def _gpt2_meta() -> object:
    """A 2-layer GPT-2 on the meta device: its blocks sit at `transformer.h`, not at a `.layers` list."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def test_decoder_layers_are_found_wherever_the_model_keeps_them() -> None:
    """The rule is the model's own blocks, not an attribute name: GPT-2's `transformer.h` counts."""
    model = _gpt2_meta()
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["GPT2Block", "GPT2Block"]
    assert decoder_layers_prefix(model) == "transformer.h."


def test_the_planner_and_the_run_share_one_decoder_layer_rule() -> None:
    """Exactly one function in src/zerofit decides what the decoder layers are (levers/layers.py)."""
    homes = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name in ("decoder_layers", "_layers_prefix")
    ]
    assert len(homes) == 1 and homes[0].startswith("levers/layers.py:"), homes
