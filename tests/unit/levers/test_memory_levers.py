"""The memory levers of long context, each exact: `train.tiled_mlp`, `train.activation_offload`,
`train.lean_norm`, and `quantization.fp32_residual` (whose `false` is a stated change of numerics, not an exact lever).

On tiny-llama in fp32 with ragged rows: the tiled MLP, the offloaded checkpoint inputs, the lean RMSNorms
(checkpointed, so their recomputation runs too) and all together
give the plain model's loss (1e-6) and the gradient of every trainable parameter (1e-6 + 2e-5 relative),
full fine-tuning and LoRA, with activation checkpointing on the same layers; a 4-step run per lever follows
the reference loss curve within 2e-5. And each lever does what it is for: the tiled MLP's saved
intermediates peak at one shard's, the offload hands autograd a host copy and lets the original go.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import zerofit
from config_helpers import config
from launch_helpers import varied_length_data
from zerofit.core.errors import ConfigError
from zerofit.data import Example, collate
from zerofit.levers.layers import decoder_layers
from zerofit.levers.offload import ActivationOffload
from zerofit.levers.tiling import enable_tiled_mlp
from zerofit.models.build import build_model

ROWS = [  # ragged: 12, 7 and 4 tokens, padded to 12
    Example(list(range(60, 72)), [-100] * 5 + list(range(65, 72))),
    Example([1, 40, 41, 42, 43, 44, 2], [-100, -100, -100, 42, 43, 44, 2]),
    Example([1, 50, 51, 2], [-100, -100, 51, 2]),
]
BATCH = collate(ROWS, pad_id=0)
LEVERS = {
    "tiled-3": {"tiled_mlp": 3},
    "offload": {"activation_checkpointing": True, "activation_offload": True},
    "lean-norm": {"lean_norm": True, "activation_checkpointing": True},
    "all-on-layer-1": {
        "tiled_mlp": 2,
        "activation_checkpointing": 1,
        "activation_offload": True,
        "lean_norm": True,
    },
}


def _build(lora: bool, dropout: float = 0.0, **train: Any) -> Any:
    return build_model(
        config(
            {"seed": 0, "lora": {"dropout": dropout, "enabled": lora}},
            train={"precision": "fp32", **train},
        )
    )


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**BATCH).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module", params=[False, True], ids=["full", "lora"])
def reference(request: pytest.FixtureRequest) -> tuple[bool, torch.Tensor, dict[str, torch.Tensor]]:
    return (request.param, *_loss_and_grads(_build(request.param).model))


@pytest.mark.parametrize("lever", LEVERS)
def test_lever_gives_the_plain_models_loss_and_gradients(reference: Any, lever: str) -> None:
    lora, ref_loss, ref_grads = reference
    built = _build(lora, **LEVERS[lever])
    loss, grads = _loss_and_grads(built.model)
    assert torch.allclose(loss, ref_loss, atol=1e-6, rtol=0)
    assert grads.keys() == ref_grads.keys() and ref_grads
    assert lora == all("lora_" in name for name in grads)
    for name, grad in ref_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=2e-5), name
    mlp_forwards = {type(layer.mlp).forward for layer in decoder_layers(built.model)}
    tiled = [getattr(layer.mlp, "_z3_leaf", False) for layer in decoder_layers(built.model)]
    assert all(tiled) == ("tiled_mlp" in LEVERS[lever]) and len(mlp_forwards) == 1  # the lever was on
    lean = ["forward" in vars(m) for m in built.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(lean) == 5 and all(lean) == ("lean_norm" in LEVERS[lever])  # 2 per layer + the final norm


def test_lean_norm_outlives_evaluation_and_hub_kernels_stay_off() -> None:
    """An evaluation flips the model to eval() and back: with the Hub's `kernels` package importable,
    transformers 5 re-kernelizes on each flip and re-binds every norm's forward unless the load turned its
    kernelization off, which would leave `train.lean_norm=true` said and not applied after the first eval."""
    built = _build(True, lean_norm=True)
    hf = built.model.get_base_model()
    assert not getattr(hf, "use_kernels", False)  # zerofit's `train.kernels` is the only kernel switch
    built.model.eval()
    built.model.train()
    norms = [m for m in built.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 5 and all("forward" in vars(m) for m in norms)


def test_tiled_mlp_replays_lora_dropout_in_backward() -> None:
    """With dropout the backward's recompute must draw the forward's masks: one shard draws exactly what
    the plain MLP draws, so with the RNG replayed the gradients are the plain model's."""
    grads = {}
    for name, train in {"plain": {}, "tiled-1": {"tiled_mlp": 1}}.items():
        model = _build(True, dropout=0.2, **train).model
        torch.manual_seed(123)
        grads[name] = _loss_and_grads(model)
    assert torch.equal(grads["plain"][0], grads["tiled-1"][0])
    for param, grad in grads["plain"][1].items():
        assert torch.allclose(grads["tiled-1"][1][param], grad, atol=1e-6, rtol=2e-5), param


def _peak_saved_bytes(mlp: torch.nn.Module, x: torch.Tensor) -> int:
    """The most bytes autograd holds saved at once over one forward and backward of `mlp`: each storage
    counted once, from the first pack of a tensor on it until autograd has dropped every tensor saved on
    it (parameters and views of them, e.g. the transposed weights matmuls save, excluded)."""
    weights = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors holding it]
    peak = [0]

    class Held:
        def __init__(self, t: torch.Tensor) -> None:
            self.t, key = t, t.untyped_storage().data_ptr()
            live.setdefault(key, [t.untyped_storage().nbytes(), 0])[1] += 1
            peak[0] = max(peak[0], sum(n for n, _ in live.values()))
            weakref.finalize(self, release, key)

    def release(key: int) -> None:
        live[key][1] -= 1
        if live[key][1] == 0:
            del live[key]

    def pack(t: torch.Tensor) -> Any:
        return t if t.untyped_storage().data_ptr() in weights else Held(t)

    def unpack(held: Any) -> torch.Tensor:
        return held if isinstance(held, torch.Tensor) else held.t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        mlp(x).sum().backward()  # sum's backward saves nothing
    gc.collect()
    return peak[0]


def test_tiled_mlp_intermediates_exist_for_one_shard_at_a_time() -> None:
    """tiny-llama's MLP (64 -> 176) over 512 tokens: what autograd saves peaks at the plain MLP's
    intermediates untiled, and drops ~4x from 1 shard to 4 (forward saves only the input)."""
    peaks = {}
    for shards in (0, 1, 4):
        model = _build(True).model
        layers = decoder_layers(model)
        enable_tiled_mlp(layers, shards)
        x = torch.randn(2, 256, 64, requires_grad=True)
        peaks[shards] = _peak_saved_bytes(layers[0].mlp, x)
    intermediate, x_bytes = 2 * 256 * 176 * 4, 2 * 256 * 64 * 4  # tokens x intermediate, x (fp32)
    assert peaks[0] >= 3 * intermediate  # gate, up, act(gate) (and more) all saved at once
    assert peaks[1] >= 3 * intermediate  # one shard = all tokens, but only inside backward
    # Beyond the MLP input (saved for the whole call), 4 shards keep about a quarter of 1 shard's bytes.
    assert peaks[4] - x_bytes < 0.3 * (peaks[1] - x_bytes)


def test_offload_hands_autograd_a_host_copy_and_releases_the_original() -> None:
    """On CPU the mechanism runs with a plain host copy: the packed object does not keep the tensor it
    replaced alive, and unpack returns the host buffer (same values, not the original's storage)."""
    offload = ActivationOffload()
    original = torch.randn(3, 5, 64)
    values, gone = original.clone(), weakref.ref(original)
    packed = offload.pack(original)
    del original
    gc.collect()
    assert gone() is None  # nothing of the offload holds the layer input
    restored = offload.unpack(packed)
    assert restored.data_ptr() == packed.host.data_ptr() and torch.equal(restored, values)
    assert offload.take_offloaded_bytes() == 3 * 5 * 64 * 4 and offload.offloaded_bytes == 0
    weight = torch.nn.Parameter(torch.ones(2))
    assert offload.pack(weight) is weight  # parameters are kept anyway: never copied


def test_offload_takes_exactly_the_checkpointed_layers_inputs() -> None:
    """One of tiny-llama's two layers checkpointed: one forward offloads that layer's input (rows x
    tokens x hidden, fp32) and nothing else; backward gets it back through unpack."""
    built = _build(True, activation_checkpointing=1, activation_offload=True)
    offload = built.activation_offload
    assert offload is not None
    unpacked = []
    unpack = offload.unpack
    offload.unpack = lambda packed: unpacked.append(packed) or unpack(packed)  # type: ignore[method-assign]
    loss = built.model(**BATCH).loss
    assert offload.take_offloaded_bytes() == 3 * 12 * 64 * 4
    loss.backward()
    assert len(unpacked) == 1 and unpacked[0].host.shape == (3, 12, 64)


@pytest.mark.parametrize(
    ("train", "words"),
    [
        ({"activation_offload": True}, ["train.activation_offload = true", "train.activation_checkpointing"]),
        ({"activation_offload": True, "activation_checkpointing": 0}, ["cross PCIe"]),
        ({"activation_offload": "auto", "activation_checkpointing": True}, ["train.activation_offload"]),
        ({"tiled_mlp": "auto"}, ["train.tiled_mlp = 'auto'", "train.tiled_mlp=4"]),
        ({"lean_norm": "auto"}, ["train.lean_norm = 'auto'", "train.lean_norm=true"]),
    ],
)
def test_lever_settings_the_model_cannot_run_are_refused_before_loading(
    train: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        _build(True, **train)
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


def test_tiled_mlp_true_names_no_shard_count() -> None:
    with pytest.raises(ConfigError, match=r"train.tiled_mlp = True: must be a number of token shards"):
        config({}, train={"tiled_mlp": True})


@pytest.mark.parametrize("fp32_residual", [True, False])
def test_fp32_residual_decides_the_residual_streams_dtype_under_qlora(fp32_residual: bool) -> None:
    """4-bit QLoRA at bf16 (bitsandbytes runs on CPU): with the key the norms and embeddings are upcast
    and every decoder layer's output (the residual stream) is fp32; without it all stays bf16."""
    built = build_model(
        config(
            {"seed": 0, "lora": {"dropout": 0.0}},
            train={"precision": "bf16"},
            quantization={"load_in": "4bit", "fp32_residual": fp32_residual},
        )
    )
    expected = torch.float32 if fp32_residual else torch.bfloat16
    seen: list[torch.dtype] = []
    for layer in decoder_layers(built.model):
        layer.register_forward_hook(
            lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out)
        )
    loss = built.model(**BATCH).loss
    assert [t.dtype for t in seen] == [expected, expected]  # type: ignore[attr-defined]
    norms = [p for n, p in built.model.named_parameters() if "norm" in n or "embed_tokens" in n]
    assert norms and {p.dtype for p in norms} == {expected}
    loss.backward()
    assert all(p.grad is not None for p in built.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("fp32_residual", [True, False])
def test_lean_norm_composes_with_qlora(fp32_residual: bool) -> None:
    """4-bit QLoRA at bf16 under autocast, checkpointed: the lean RMSNorm's forward is HF's bit for bit,
    so the loss is the same number; the adapters' gradients agree to bf16 rounding (fp32 residual: the
    norms' input is fp32 already)."""
    out = {}
    for lean in (False, True):
        built = build_model(
            config(
                {"seed": 0, "lora": {"dropout": 0.0}},
                train={"precision": "bf16", "activation_checkpointing": True, "lean_norm": lean},
                quantization={"load_in": "4bit", "fp32_residual": fp32_residual},
            )
        )
        norms = [m for m in built.model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all("forward" in vars(m) for m in norms) == lean
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = built.model(**BATCH).loss
        loss.backward()
        grads = {n: p.grad.float() for n, p in built.model.named_parameters() if p.grad is not None}
        out[lean] = (loss.detach(), grads)
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1].keys() == out[False][1].keys() and out[False][1]
    for name, grad in out[False][1].items():
        scale = grad.abs().max().item()
        assert torch.allclose(out[True][1][name], grad, rtol=0, atol=2e-2 * scale + 1e-8), name


@pytest.mark.slow
def test_each_lever_follows_the_reference_loss_curve(tmp_path: Path) -> None:
    """Four optimizer steps (global 4 = micro 2 x 2 accumulation, varied-length data) per lever in this
    process: the per-step losses match the plain run's within 2e-5."""
    data = varied_length_data(tmp_path / "varied.jsonl", 16)
    base = {
        "seed": 3,
        "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "distributed": {"strategy": "single"},
        "train": {"max_steps": 4, "precision": "fp32"},
        "optimizer": {"lr": 1e-2},
        "lora": {"dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64},
        "checkpoint": {"save_final": False, "every_minutes": 0},
        "logging": {"console": False, "wandb": {"mode": "disabled"}},
    }
    saved_env = dict(os.environ)  # train() sets the one-process rendezvous variables, as the launcher does
    try:
        curves = {
            name: [
                row["loss"]
                for row in zerofit.train(
                    base,
                    output_dir=str(tmp_path / "runs"),
                    run_name=name,
                    **{f"train.{k}": v for k, v in train.items()},
                ).metrics
            ]
            for name, train in {"reference": {}, **LEVERS}.items()
        }
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert len(curves["reference"]) == 4 and curves["reference"][0] != curves["reference"][-1]
    for name in LEVERS:
        assert curves[name] == pytest.approx(curves["reference"], abs=2e-5, rel=0), name


def test_the_launch_plan_names_each_lever_that_is_on_with_its_setting() -> None:
    from types import SimpleNamespace

    from zerofit.recipe.run_report import describe_compute

    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(num_hidden_layers=4)  # type: ignore[assignment]
    on = config(
        {"batch": {"micro_batch_size": 1}},
        train={"tiled_mlp": 16, "activation_checkpointing": 2, "activation_offload": True, "lean_norm": True},
    )
    text = describe_compute(on, model)
    assert "tiled MLP 16 shards" in text
    assert "activation offload on (inputs of the 2 checkpointed layers -> pinned host memory)" in text
    assert "lean norm on" in text
    off = describe_compute(
        config({"batch": {"micro_batch_size": 1}}, train={"activation_checkpointing": 2}), model
    )
    assert not any(word in off for word in ("tiled MLP", "activation offload", "lean norm"))
