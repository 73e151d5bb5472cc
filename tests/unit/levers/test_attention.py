"""The varlen attention path (`model.attn_implementation=varlen`, zerofit.levers.attention): exact, no dense mask.

On tiny-llama in fp32 (4 query heads over 2 key/value heads: GQA): packed ragged rows and a padded micro-batch
give the dense-mask sdpa reference's logits on every real token, its loss and the gradient of every
parameter; a 4-step packed run follows sdpa's loss curve within 2e-5. The mask hook finds the documents as
cu_seqlens and never returns a (B, 1, S, S) tensor where there are documents; it falls back to sdpa's own
mask for a KV cache (generation gives sdpa's tokens). The kernel choice is a table of what is installed and
what the device runs; explicit kernels that cannot run are refused as one paragraph; `auto` resolves to
varlen exactly where sdpa would build a dense mask; the planner drops the mask terms, says which kernel it
plans, and its varlen terms agree with the FakeTensor trace within 5% at the Llama-3.1-8B shape.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zerofit
from config_helpers import config
from launch_helpers import varied_length_data
from zerofit.core.errors import ConfigError
from zerofit.data import Example, collate
from zerofit.data.packing import collate_packed
from zerofit.levers.attention import (
    FLASH_ATTN,
    PER_DOCUMENT,
    TORCH_VARLEN,
    Documents,
    choose_kernel,
    module_kernel,
    varlen_attention,
    varlen_mask,
)
from zerofit.models.build import build_model, varlen_kernel
from zerofit.planner.activations.peak import activation_terms
from zerofit.planner.activations.terms import TermKind
from zerofit.planner.scenario import Scenario
from zerofit.resolution import resolve


def _ex(n: int, first: int) -> Example:
    ids = list(range(first, first + n))
    return Example(ids, [-100, *ids[1:]])


PACKED = collate_packed([[_ex(5, 10), _ex(9, 30), _ex(3, 50)], [_ex(12, 70), _ex(2, 90)]], pad_id=0)
PADDED = collate([_ex(12, 10), _ex(7, 30), _ex(4, 60)], pad_id=0)


def _model(attn: str, **train: Any) -> torch.nn.Module:
    cfg = config(
        {"seed": 0, "lora": {"enabled": False}, "model": {"attn_implementation": attn}},
        train={"precision": "fp32", **train},
    )
    return build_model(cfg).model


# The memory levers a long-context run combines varlen with: every decoder layer recomputed in backward
# (it receives the documents again), its input offloaded to host memory, the MLP in token shards.
LEVERS = {"activation_checkpointing": True, "activation_offload": True, "tiled_mlp": 2}


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "position_ids") if "position_ids" in batch else ("input_ids", "attention_mask")
    return {k: batch[k] for k in keys}


def _run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    out = model(**_inputs(batch), labels=batch["labels"], use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("levers", [{}, LEVERS], ids=["plain", "with-levers"])
@pytest.mark.parametrize("batch", [PACKED, PADDED], ids=["packed-ragged-rows", "padded-micro-batch"])
def test_varlen_gives_the_dense_mask_sdpa_logits_loss_and_gradients(
    batch: dict[str, torch.Tensor], levers: dict[str, Any]
) -> None:
    ref_logits, ref_loss, ref_grads = _run(_model("sdpa"), batch)
    varlen = _model("varlen", **levers)
    assert module_kernel(varlen) == PER_DOCUMENT  # CPU: the exact per-document sdpa
    logits, loss, grads = _run(varlen, batch)
    real = batch["attention_mask"].bool()
    assert torch.allclose(logits[real], ref_logits[real], atol=1e-5, rtol=0)
    assert torch.isfinite(logits).all()  # padded queries attend within their padding run
    assert torch.allclose(loss, ref_loss, atol=1e-6, rtol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, grad in ref_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=2e-5), name


def _mistral(attn: str, window: int | None) -> torch.nn.Module:
    """A 2-layer Mistral (GQA) whose sliding window is shorter than most documents here (seeded weights)."""
    from transformers import MistralConfig, MistralForCausalLM

    from zerofit.levers.attention import hf_attn_implementation

    cfg = MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=window, max_position_embeddings=64,
    )  # fmt: skip
    cfg._attn_implementation = hf_attn_implementation(attn)
    torch.manual_seed(0)
    return MistralForCausalLM(cfg)


@pytest.mark.parametrize("batch", [PACKED, PADDED], ids=["packed-ragged-rows", "padded-micro-batch"])
def test_varlen_keeps_a_sliding_window_within_each_document(batch: dict[str, torch.Tensor]) -> None:
    ref_logits, ref_loss, ref_grads = _run(_mistral("sdpa", 4), batch)
    logits, loss, grads = _run(_mistral("varlen", 4), batch)
    real = batch["attention_mask"].bool()
    assert torch.allclose(logits[real], ref_logits[real], atol=1e-5, rtol=0)
    assert torch.allclose(loss, ref_loss, atol=1e-6, rtol=0)
    for name, grad in ref_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=2e-5), name
    unwindowed = _run(_mistral("varlen", None), batch)[0]
    assert not torch.allclose(unwindowed[real], ref_logits[real], atol=1e-3)  # the window was in force


def test_the_mask_hook_finds_documents_and_builds_no_dense_mask() -> None:
    from transformers.masking_utils import create_causal_mask

    model = _model("varlen")
    embeds = torch.zeros(2, PACKED["input_ids"].shape[1], 8)
    kwargs = {"config": model.config, "inputs_embeds": embeds, "cache": None}
    docs = create_causal_mask(attention_mask=None, position_ids=PACKED["position_ids"], **kwargs)
    assert isinstance(docs, Documents)
    # Row 0: documents of 5, 9, 3 tokens (17 of 17); row 1: 12, 2 and 3 tokens of padding.
    assert docs.bounds == (0, 5, 14, 17, 29, 31, 34) and docs.max_len == 12
    assert docs.cu_seqlens.dtype == torch.int32
    padded = create_causal_mask(
        attention_mask=PADDED["attention_mask"],
        position_ids=None,
        **{**kwargs, "inputs_embeds": torch.zeros(3, 12, 8)},
    )
    assert isinstance(padded, Documents) and padded.bounds == (0, 12, 19, 24, 28, 36)
    plain = create_causal_mask(attention_mask=torch.ones(2, 17), position_ids=None, **kwargs)
    assert plain is None  # one unpadded sequence per row: sdpa's is_causal path, no mask at all
    with pytest.raises(ValueError, match="gap inside a row"):
        varlen_mask(1, 4, 4, attention_mask=torch.tensor([[1, 0, 1, 1]]))
    # A KV cache (q shorter than kv): transformers' own sdpa mask, as today.
    cached = varlen_mask(1, 1, 5, q_offset=4, attention_mask=torch.ones(1, 5, dtype=torch.bool))
    assert cached is None or isinstance(cached, torch.Tensor)


def test_generation_with_varlen_gives_sdpas_tokens() -> None:
    prompt = torch.tensor([[5, 6, 7, 8]])
    tokens = [
        _model(attn).generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for attn in ("sdpa", "varlen")
    ]
    assert torch.equal(tokens[0], tokens[1])


CUDA_BF16 = ("cuda", torch.bfloat16, (9, 0))


@pytest.mark.parametrize(
    ("device", "installed", "expected"),
    [
        (CUDA_BF16, {FLASH_ATTN: True, TORCH_VARLEN: True}, FLASH_ATTN),
        (CUDA_BF16, {FLASH_ATTN: False, TORCH_VARLEN: True}, TORCH_VARLEN),
        (CUDA_BF16, {FLASH_ATTN: False, TORCH_VARLEN: False}, PER_DOCUMENT),
        (("cuda", torch.float32, (9, 0)), {FLASH_ATTN: True, TORCH_VARLEN: True}, PER_DOCUMENT),
        (("cuda", torch.float16, (7, 5)), {FLASH_ATTN: True, TORCH_VARLEN: True}, PER_DOCUMENT),
        (("cpu", torch.bfloat16, None), {FLASH_ATTN: True, TORCH_VARLEN: True}, PER_DOCUMENT),
    ],
)
def test_auto_picks_the_best_kernel_the_device_runs(
    device: tuple[Any, ...], installed: dict[str, bool], expected: str
) -> None:
    assert choose_kernel("auto", *device, {**installed, PER_DOCUMENT: True}) == expected


def test_an_explicit_kernel_that_cannot_run_is_refused() -> None:
    everything = {FLASH_ATTN: True, TORCH_VARLEN: True, PER_DOCUMENT: True}
    assert choose_kernel(TORCH_VARLEN, *CUDA_BF16, everything) == TORCH_VARLEN
    with pytest.raises(
        ConfigError,
        match=r"model.varlen_kernel = 'flash_attn': the kernel is not installed .*varlen_kernel=auto",
    ):
        choose_kernel(FLASH_ATTN, *CUDA_BF16, {**everything, FLASH_ATTN: False})
    # At load: this machine has no CUDA, so torch's varlen (a CUDA kernel) is refused before any weights load.
    cfg = config(
        {"model": {"attn_implementation": "varlen", "varlen_kernel": "torch_varlen"}},
        train={"precision": "bf16"},
    )
    if not torch.cuda.is_available():
        with pytest.raises(
            ConfigError, match=r"needs CUDA, fp16/bf16 and compute capability 8.0\+ \(this run: cpu"
        ):
            varlen_kernel(cfg)


@pytest.mark.parametrize(
    ("model", "train", "match"),
    [
        (
            {"varlen_kernel": "torch_varlen"},
            {"precision": "fp32"},
            r"runs in bf16/fp16 only; set train.precision=bf16",
        ),
        (
            {"attn_implementation": "sdpa", "varlen_kernel": "sdpa_per_document"},
            {},
            r"set model.attn_implementation=varlen",
        ),
    ],
)
def test_resolve_refuses_kernels_the_run_cannot_use(
    model: dict[str, str], train: dict[str, str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(config({"model": model}, train=train), 1)
    if importlib_missing("flash_attn"):
        with pytest.raises(
            ConfigError, match=r"flash_attn is not installed here; install it \(pip install flash-attn"
        ):
            resolve(config({"model": {"varlen_kernel": "flash_attn"}}, train={"precision": "bf16"}), 1)


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


@pytest.mark.parametrize(
    ("model", "expected"),
    [({}, "varlen"), ({"trust_remote_code": True}, "sdpa"), ({"attn_implementation": "eager"}, "eager")],
)
def test_auto_resolves_to_varlen_except_for_remote_code(model: dict[str, Any], expected: str) -> None:
    """`auto` is varlen whatever the micro-batch (its hook is plain sdpa where there are no documents, see
    the mask-hook test), sdpa for remote code (which need not build masks through transformers)."""
    cfg = config(
        {"distributed": {"strategy": "single"}, "model": model},
        batch={"global_batch_size": 8, "micro_batch_size": 1},
    )
    assert resolve(cfg, 1).config.model.attn_implementation == expected


@pytest.mark.slow
def test_varlen_follows_sdpas_loss_curve_on_packed_rows(tmp_path: Path) -> None:
    """Four optimizer steps on packed ragged rows (token budget 128 = 2 rows of 64, 2 accumulation steps),
    LoRA in fp32: varlen's per-step losses are sdpa's within 2e-5."""
    base = {
        "seed": 3,
        "batch": {"global_batch_size": 8, "tokens_per_micro_batch": 128},
        "distributed": {"strategy": "single"},
        "train": {"max_steps": 4, "precision": "fp32"},
        "optimizer": {"lr": 1e-2},
        "data": {"path": str(varied_length_data(tmp_path / "varied.jsonl", 32)), "max_seq_len": 64},
        "checkpoint": {"save_final": False, "every_minutes": 0},
        "logging": {"console": False, "wandb": {"mode": "disabled"}},
    }
    saved_env = dict(os.environ)  # train() sets the one-process rendezvous variables, as the launcher does
    try:
        curves = {
            attn: [
                row["loss"]
                for row in zerofit.train(
                    base,
                    output_dir=str(tmp_path / "runs"),
                    run_name=attn,
                    **{"model.attn_implementation": attn},
                ).metrics
            ]
            for attn in ("sdpa", "varlen")
        }
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert len(curves["sdpa"]) == 4 and curves["sdpa"][0] != curves["sdpa"][-1]
    assert curves["varlen"] == pytest.approx(curves["sdpa"], abs=2e-5, rel=0)


L31 = "meta-llama/Llama-3.1-8B"
PACKED_16K = Scenario(
    model=L31,
    seq_len=16384,
    micro_batch_size=2,
    quantization="4bit",
    activation_checkpointing=True,
    packed=True,
)


def _kinds(scn: Scenario) -> set[TermKind]:
    """The kinds of what one decoder layer saves per token."""
    return {t.kind for t in activation_terms(scn).per_layer_token_terms}


def test_the_planner_drops_the_dense_mask_under_varlen() -> None:
    from dataclasses import replace

    varlen = replace(PACKED_16K, attn_implementation="varlen", varlen_kernel=TORCH_VARLEN)
    assert TermKind.PADDING_MASK in _kinds(PACKED_16K) and TermKind.PADDING_MASK not in _kinds(varlen)
    sdpa_attn, varlen_attn = (
        next(t for t in activation_terms(s).per_layer_token_terms if t.kind is TermKind.ATTENTION)
        for s in (PACKED_16K, varlen)
    )
    # Keys and values at their own 8 heads (not repeated to 32): 2 x 2 x (4096 - 1024) bytes less per token.
    assert sdpa_attn.bytes - varlen_attn.bytes == 2 * 2 * (4096 - 1024)
    assert "torch_varlen" in varlen_attn.label
    # The boolean (B, 1, S, S) mask the checkpoints kept is gone: 2 x 16384^2 bytes.
    rotary = {
        s: next(t for t in activation_terms(s).terms if t.kind is TermKind.ROTARY).bytes
        for s in (PACKED_16K, varlen)
    }
    assert rotary[PACKED_16K] - rotary[varlen] == 2 * 16384 * 16384


TRACE_CASES = {
    # QLoRA, one packed 16k row: the documents through torch's varlen op (its fake implementation).
    "qlora-packed-16k": Scenario(
        model=L31, seq_len=16384, micro_batch_size=1, quantization="4bit", activation_checkpointing=True,
        packed=True, attn_implementation="varlen", varlen_kernel=TORCH_VARLEN,
    ),
    # LoRA under autocast, a padded micro-batch of 2 x 8k: q, k, v cast to bf16 for the kernel as sdpa gets them.
    "lora-padded-2x8k": Scenario(
        model=L31, seq_len=8192, micro_batch_size=2, activation_checkpointing=True,
        attn_implementation="varlen", varlen_kernel=TORCH_VARLEN,
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRACE_CASES))
def test_varlen_terms_match_the_trace(name: str) -> None:
    from zerofit.planner.estimate import estimate
    from zerofit.planner.trace import trace_memory

    scn = TRACE_CASES[name]
    traced = trace_memory(scn)
    assert abs(estimate(scn).tensors_gib / traced.tensors_gib - 1) < 0.05, traced.as_dict()


def test_plan_says_which_attention_path_and_kernel() -> None:
    from zerofit.api import plan

    report = plan(
        {"distributed": {"strategy": "single"}, "batch": {"global_batch_size": 8, "micro_batch_size": 4}}
    )
    attention = report["memory"]["attention"]
    assert attention["implementation"] == "varlen" and attention["dense_mask"] is False
    assert attention["kernel"] in (TORCH_VARLEN, FLASH_ATTN)  # planned for a CUDA card in bf16
    assert "no dense mask" in attention["text"]


def test_soft_capped_attention_plans_eager_and_is_never_run_by_varlen() -> None:
    """Gemma-2 caps its attention logits, which neither sdpa nor the varlen kernels compute: `auto` resolves to
    eager for it, an explicit varlen is refused before the load, and the hook itself refuses a softcap."""
    from zerofit.models.build import check_attention_before_load, resolve_model_path

    batch = {"global_batch_size": 4, "micro_batch_size": 1}
    gemma2 = config({"model": {"name_or_path": "tiny-gemma2"}, "batch": batch})
    assert resolve(gemma2, 1).config.model.attn_implementation == "eager"
    llama = config({"batch": batch})
    assert resolve(llama, 1).config.model.attn_implementation == "varlen"  # a Llama keeps varlen
    path = resolve_model_path(config({"model": {"name_or_path": "tiny-gemma2"}}))
    with pytest.raises(
        ConfigError, match=r"model.attn_implementation = 'varlen': Gemma2ForCausalLM .*=eager"
    ):
        check_attention_before_load(path, "varlen")
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="soft-caps its attention logits"):
        varlen_attention(torch.nn.Linear(1, 1), q, q, q, None, softcap=50.0)
