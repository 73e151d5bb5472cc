"""The planner knows the long-context levers: their memory terms, their speed costs, `auto` for
`train.tiled_mlp` / `train.activation_offload` / `train.lean_norm` decided by the chooser, and
`zerofit plan --max-context`.

All analytic (no trace): each test builds scenarios at the Llama-3.1-8B shape and checks one lever's term
against the lever's facts (zerofit.token_loss.fused / tiling / offload / norms docstrings)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from zerofit.catalogue.gpus import GPUS
from zerofit.config.loader import load_config
from zerofit.core.errors import ConfigError
from zerofit.planner import choose_fastest_plan
from zerofit.planner.activations.peak import activation_terms
from zerofit.planner.activations.terms import TermKind
from zerofit.planner.context import lever_combinations, max_context
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import Scenario
from zerofit.planner.search.budget import resolve_budget
from zerofit.planner.search.remedies import remedies
from zerofit.planner.shapes import model_shape
from zerofit.planner.speed import flops_per_token, predict_speed
from zerofit.resolution import resolve
from zerofit.token_loss.sums import chunk_tokens

REPO = Path(__file__).resolve().parents[3]
L31 = "meta-llama/Llama-3.1-8B"
RECIPE = REPO / "configs" / "llama31-8b-qlora-longctx-3090.yaml"
LORA_RECIPE = REPO / "configs" / "llama31-8b-lora-longctx-3090.yaml"
QLORA = Scenario(
    model=L31, seq_len=16384, micro_batch_size=1, quantization="4bit", activation_checkpointing=True
)


def _all_kinds(scn: Scenario) -> set[TermKind]:
    return {t.kind for m in activation_terms(scn).moments for t in m.terms}


def test_fused_linear_holds_no_logits_and_one_chunk() -> None:
    fused = replace(QLORA, cross_entropy="fused_linear")
    acts = activation_terms(fused)
    assert TermKind.LOGITS not in _all_kinds(fused) and TermKind.LOGITS in _all_kinds(QLORA)
    v, h = 128256, 4096
    fwd = next(m for m in acts.moments if m.where.startswith("loss forward"))
    temps = [t.bytes for t in fwd.terms if t.kind is TermKind.FUSED_LOSS_TEMPORARY]
    # One chunk (8 C V) and the bf16 cast of QLoRA's fp32 head (V H 2).
    assert sorted(temps) == sorted([8 * chunk_tokens(v) * v, v * h * 2])
    assert estimate(fused).tensors_gib < estimate(QLORA).tensors_gib - 3  # 2 x 4 GiB of logits gone


def test_tiled_mlp_keeps_the_mlp_input_and_one_shard_of_intermediates() -> None:
    tiled = replace(QLORA, tiled_mlp=8)
    kinds = {t.kind for t in activation_terms(tiled).per_layer_token_terms}
    assert TermKind.TILED_MLP_INPUT in kinds and TermKind.SWIGLU not in kinds
    plain, sharded = activation_terms(QLORA), activation_terms(tiled)
    per_tok = sum(t.bytes for t in plain.per_layer_token_terms)
    tiled_tok = sum(t.bytes for t in sharded.per_layer_token_terms)
    # SwiGLU (3 x fp32 x 14336) and the down projection's input leave the layer's saves.
    assert per_tok - tiled_tok >= 3 * 4 * 14336
    shard = sum(t.bytes for m in sharded.moments for t in m.terms if t.kind is TermKind.MLP_SHARD)
    assert 0 < shard < (per_tok - tiled_tok) * QLORA.seq_len / 4  # about 1/8 of the intermediates
    assert estimate(tiled).tensors_gib < estimate(QLORA).tensors_gib


def test_offload_moves_checkpointed_inputs_to_host_ram() -> None:
    off = replace(QLORA, activation_offload=True)
    row = QLORA.seq_len * 4096 * 4  # fp32 residual
    on_gpu = activation_terms(off).bytes_of(TermKind.CHECKPOINTED_INPUTS)
    assert on_gpu in (0, 2 * row)  # at most 2 layer inputs (0 when the peak moment holds none)
    host = activation_terms(off).host
    assert [t.bytes for t in host] == [32 * row]
    est = estimate(off)
    assert est.host_ram_gib - estimate(QLORA).host_ram_gib == pytest.approx(32 * row / 2**30)
    assert est.tensors_gib < estimate(QLORA).tensors_gib - 6  # 30 of 32 layer inputs (7.5 GiB) left


def test_fp32_residual_false_halves_the_residual_stream() -> None:
    lean = replace(QLORA, fp32_residual=False)
    full_ckpt = activation_terms(QLORA).moments[0].terms
    lean_ckpt = activation_terms(lean).moments[0].terms
    ckpt = [t.bytes for t in full_ckpt if t.kind is TermKind.CHECKPOINTED_INPUTS]
    assert [t.bytes for t in lean_ckpt if t.kind is TermKind.CHECKPOINTED_INPUTS] == [ckpt[0] // 2]
    assert estimate(lean).total_gib < estimate(QLORA).total_gib - 4


# bf16 LoRA on ZeRO-2 (the LoRA long-context recipe's engine: adapters computed in bf16), 32k tokens.
LORA_32K = Scenario(
    model=L31,
    seq_len=32768,
    micro_batch_size=1,
    strategy="deepspeed",
    zero_stage=2,
    activation_checkpointing=True,
    cross_entropy="fused_linear",
    tiled_mlp=4,
    activation_offload=True,
)


def test_lean_norm_saves_each_norms_input_as_it_is() -> None:
    h = 4096
    lean = replace(LORA_32K, lean_norm=True)
    norms = {
        scn.lean_norm: [
            t.bytes for t in activation_terms(scn).per_layer_token_terms if t.kind is TermKind.NORMS
        ]
        for scn in (LORA_32K, lean)
    }
    # HF: 2 x (fp32 upcast + rstd); lean: 2 x (the bf16 input + rstd).
    assert norms == {False: [2 * (4 * h + 4)], True: [2 * (2 * h + 4)]}
    recomputed = {
        scn.lean_norm: activation_terms(scn).bytes_of(TermKind.RECOMPUTED_LAYER) // scn.seq_len
        for scn in (LORA_32K, lean)
    }
    # The recomputed layer's first norm saves the checkpointed input itself: only rstd is new there.
    assert recomputed[False] - recomputed[True] == 2 * (4 * h + 4) - (2 * h + 4) - 4
    assert estimate(lean).tensors_gib < estimate(LORA_32K).tensors_gib - 0.5
    # With an fp32 residual stream HF's upcast is the input itself: LoRA saves the same either way.
    fp32 = replace(QLORA, lean_norm=True)
    assert activation_terms(fp32).per_layer_token_terms[0].bytes == 2 * (4 * h + 4)


def test_speed_model_charges_each_lever() -> None:
    shape = model_shape(L31)
    base, _ = flops_per_token(QLORA)
    tiled, _ = flops_per_token(replace(QLORA, tiled_mlp=4))
    fused, _ = flops_per_token(replace(QLORA, cross_entropy="fused_linear"))
    lean, _ = flops_per_token(replace(QLORA, lean_norm=True))
    assert tiled - base == 2 * 3 * 4096 * 14336 * shape.num_layers
    assert fused - base == 2 * 4096 * shape.vocab_size
    assert 0 < lean - base < 0.005 * base  # an elementwise recompute per norm: charged, and small
    card = GPUS["rtx3090"]
    off = replace(QLORA, activation_offload=True)
    assert predict_speed(off, card).step_time_s == predict_speed(QLORA, card).step_time_s  # hidden by compute
    slow_bus = replace(card, pcie_gbps=0.1)  # 34 GB of copies: longer than compute
    assert predict_speed(off, slow_bus).step_time_s > predict_speed(QLORA, slow_bus).step_time_s


def _resolved(path: Path, *overrides: str):
    return resolve(load_config(str(path), list(overrides)), 1, choose_fastest_plan)


def test_auto_levers_stay_off_where_not_needed_and_turn_on_where_needed() -> None:
    short = _resolved(RECIPE, "data.max_seq_len=4096").config.train
    assert (short.activation_offload, short.tiled_mlp) == (False, False)
    long = _resolved(RECIPE).config.train
    assert long.activation_offload is True and isinstance(long.tiled_mlp, int) and long.tiled_mlp > 1


def test_lean_norm_auto_is_on_only_where_it_is_needed_to_fit() -> None:
    assert _resolved(LORA_RECIPE, "data.max_seq_len=8192").config.train.lean_norm is False
    long = _resolved(LORA_RECIPE).config.train  # 32k: does not fit without it (31,744 tokens do)
    assert long.lean_norm is True and long.activation_offload is True


def test_the_qlora_recipe_turns_the_lean_norm_on_where_its_4bit_base_needs_it_to_fit() -> None:
    assert _resolved(RECIPE).config.train.lean_norm is False  # 64k fits without it: not paid for
    # 81,920 tokens still fit without it, in 64 MLP shards (a lean norm costs a recompute, more shards don't).
    at_80k = _resolved(RECIPE, "data.max_seq_len=81920").config.train
    assert (at_80k.lean_norm, at_80k.tiled_mlp) == (False, 64)
    assert _resolved(RECIPE, "data.max_seq_len=82944").config.train.lean_norm is True
    with pytest.raises(ConfigError, match="not even checkpointing every layer at micro 1 fits"):
        _resolved(RECIPE, "data.max_seq_len=82944", "train.lean_norm=false")  # fits only with it


def test_cross_entropy_auto_is_the_fused_loss_only_where_the_logits_do_not_fit() -> None:
    """The QLoRA recipe at 65,536 tokens fits only without the logits (128k vocabulary: 16 GiB of them and
    as much again for their gradient); at 4,096 tokens they fit and the chunked loss (no extra lm_head
    matmul) is kept. The plan's note says which, and the resolved config (config.yaml) holds no `auto`."""
    long = _resolved(RECIPE, "train.cross_entropy=auto")
    assert long.config.train.cross_entropy == "fused_linear"
    assert any(
        n.startswith("train.cross_entropy auto -> fused_linear: without the logits") for n in long.notes
    )
    with pytest.raises(ConfigError, match="not even checkpointing every layer at micro 1 fits"):
        _resolved(RECIPE, "train.cross_entropy=chunked")  # the logits are what does not fit
    short = _resolved(RECIPE, "train.cross_entropy=auto", "data.max_seq_len=4096")
    assert short.config.train.cross_entropy == "chunked"
    assert any(
        n.startswith("train.cross_entropy auto -> chunked: the plan fits with the logits")
        for n in short.notes
    )
    assert "auto" not in {long.config.train.cross_entropy, short.config.train.tiled_mlp}


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        # The demo adapts lm_head with LoRA: the fused loss needs a plain Linear head.
        (("planner.gpu=rtx3090",), "LoRA adapts lm_head"),
        (
            ("model.name_or_path=tiny-gemma2", "lora.target_modules=all-linear", "planner.gpu=rtx3090"),
            "config.final_logit_softcapping = 30.0",
        ),
        (
            ("lora.target_modules=all-linear", "model.trust_remote_code=true", "planner.gpu=rtx3090"),
            "model.trust_remote_code",
        ),
        # No GPU budget (no planner.gpu, no CUDA device here): nothing to weigh the fused loss against.
        (("lora.target_modules=all-linear",), "no GPU memory budget is known here"),
    ],
)
def test_cross_entropy_auto_keeps_the_default_where_the_fused_loss_cannot_be_chosen(
    overrides: tuple[str, ...], why: str
) -> None:
    resolved = _resolved(
        REPO / "configs" / "demo.yaml", "train.cross_entropy=auto", "distributed.strategy=single", *overrides
    )
    assert resolved.config.train.cross_entropy == "chunked"
    note = next(n for n in resolved.notes if n.startswith("train.cross_entropy auto -> chunked"))
    assert why in note


def test_an_unresolved_cross_entropy_auto_never_reaches_the_model() -> None:
    from zerofit.models.build import check_memory_levers

    with pytest.raises(ConfigError, match=r"train.cross_entropy = 'auto' reached the model unresolved"):
        check_memory_levers(
            load_config(
                str(LORA_RECIPE),
                [
                    "train.cross_entropy=auto",
                    "train.tiled_mlp=false",
                    "train.activation_offload=false",
                    "train.lean_norm=false",
                ],
            )
        )


def test_resolve_refuses_offload_without_checkpointing() -> None:
    with pytest.raises(ConfigError, match=r"train\.activation_offload = true needs activation checkpointing"):
        _resolved(RECIPE, "train.activation_offload=true", "train.activation_checkpointing=false")


def test_max_context_reaches_the_qlora_goal_and_names_its_levers() -> None:
    cfg = load_config(str(REPO / "configs" / "llama2-7b-qlora-3090.yaml"), [f"model.name_or_path={L31}"])
    budget = resolve_budget(cfg, gpu="rtx3090", detect=False)
    assert budget is not None
    mc = max_context(cfg, 1, budget)
    assert mc.tokens is not None and mc.tokens >= 65536
    assert "train.cross_entropy=fused_linear" in mc.levers and "train.activation_offload=true" in mc.levers
    assert mc.total_gib is not None and mc.total_gib <= budget.limit_gib
    assert mc.next_total_gib is not None and mc.next_total_gib > budget.limit_gib  # the longest, not less


@pytest.mark.parametrize("recipe", [RECIPE, LORA_RECIPE], ids=["qlora", "lora"])
def test_the_longest_context_max_context_reports_is_reachable_with_the_recipes_auto_levers(
    recipe: Path,
) -> None:
    """The long-context recipes' --max-context needs 64 (QLoRA) and 32 (LoRA) MLP shards;
    `train.tiled_mlp: auto` weighs the same shard counts, so setting data.max_seq_len to that length
    resolves (to those shards), not to "nothing fits"."""
    cfg = load_config(str(recipe), [])
    budget = resolve_budget(cfg, gpu="rtx3090", detect=False)
    assert budget is not None
    mc = max_context(cfg, 1, budget)
    assert mc.tokens is not None and mc.tokens > cfg.data.max_seq_len
    shards = next(int(lever.split("=")[1]) for lever in mc.levers if lever.startswith("train.tiled_mlp="))
    assert shards > 16  # beyond what auto once weighed
    train = _resolved(recipe, f"data.max_seq_len={mc.tokens}").config.train
    assert train.tiled_mlp == shards and train.activation_offload is True


def test_max_context_reaches_the_lora_goal_with_the_lean_norm() -> None:
    cfg = load_config(str(LORA_RECIPE), [f"model.name_or_path={L31}"])
    budget = resolve_budget(cfg, gpu="rtx3090", detect=False)
    assert budget is not None
    mc = max_context(cfg, 1, budget)
    assert mc.tokens is not None and mc.tokens >= 32768
    assert "train.lean_norm=true" in mc.levers and "train.activation_offload=true" in mc.levers
    # Weighed even where the config turns it off (--max-context says what the longest context needs).
    off = load_config(str(LORA_RECIPE), ["train.lean_norm=false"])
    assert any("train.lean_norm=true" in combo for combo in lever_combinations(off))
    assert mc.next_total_gib is not None and mc.next_total_gib > budget.limit_gib


def test_remedies_offer_the_long_context_levers_where_they_make_it_fit() -> None:
    cfg = load_config(
        str(REPO / "configs" / "llama2-7b-lora-3090.yaml"),
        [f"model.name_or_path={L31}", "data.max_seq_len=16384"],
    )
    budget = resolve_budget(cfg, gpu="rtx3090", detect=False)
    assert budget is not None
    by_name = {r.name: r for r in remedies(cfg, 1, budget)}
    levers = by_name["long-context levers"]
    assert levers.verdict == "fits" and levers.total_gib <= budget.limit_gib
    # The overrides that change the config, fewest that are fastest: the model and engine stay.
    assert "train.cross_entropy=fused_linear" in levers.how.split() and "distributed" not in levers.how
    applied = load_config(str(REPO / "configs" / "llama2-7b-lora-3090.yaml"), [
        f"model.name_or_path={L31}", "data.max_seq_len=16384", *levers.how.split()
    ])  # fmt: skip
    assert "long-context levers" not in {r.name for r in remedies(applied, 1, budget)}  # nothing left to add


def test_max_context_is_capped_by_the_models_positions() -> None:
    cfg = load_config(str(REPO / "configs" / "llama2-7b-qlora-3090.yaml"), [])
    budget = resolve_budget(cfg, gpu="rtx3090", detect=False)
    assert budget is not None
    out = max_context(cfg, 1, budget).as_dict()
    assert out["tokens"] == 4096 and out["limited_by"] == "max_position_embeddings"
    assert out["memory_tokens"] > 4096
    assert out["levers"] == ["batch.micro_batch_size=1", "data.max_seq_len=4096"]  # nothing else needed


@pytest.mark.slow
def test_plan_cli_max_context_json() -> None:
    cmd = [sys.executable, "-m", "zerofit.cli", "plan", "--config", str(RECIPE), "--json", "--max-context"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout)
    assert out["max_context"]["tokens"] >= 65536
    assert all("=" in lever for lever in out["max_context"]["levers"])


def test_catalogue_has_the_long_context_models() -> None:
    assert model_shape(L31).total_params == 8030261248
    assert model_shape("Qwen/Qwen3-8B").total_params == 8190735360


# The levers' terms against the FakeTensor + MemTracker trace (the levers installed as the model build does:
# tiled MLP, offload hooks, the fused head) at the Llama-3.1-8B shape and long lengths: within 5%. The trace
# runs 1 and 2 decoder layers and extrapolates (trace.py); 6-12 s each on CPU, so 32k is the longest here
# (at 65,536 tokens the all-levers QLoRA point measured +3.2%, 21 s).
TRACE_CASES = {
    "qlora-offload-16k": replace(QLORA, activation_offload=True),
    "qlora-tiled-fused-16k": replace(QLORA, tiled_mlp=4, cross_entropy="fused_linear"),
    "qlora-all-levers-32k": replace(
        QLORA,
        seq_len=32768,
        tiled_mlp=4,
        cross_entropy="fused_linear",
        activation_offload=True,
        fp32_residual=False,
    ),
    "lora-zero2-lean-norm-32k": replace(LORA_32K, lean_norm=True),
    "lora-all-levers-16k": Scenario(
        model=L31,
        seq_len=16384,
        micro_batch_size=1,
        activation_checkpointing=True,
        cross_entropy="fused_linear",
        tiled_mlp=4,
        activation_offload=True,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRACE_CASES))
def test_lever_terms_match_the_trace(name: str) -> None:
    from zerofit.planner.trace import trace_memory

    scn = TRACE_CASES[name]
    traced = trace_memory(scn)
    predicted = estimate(scn).tensors_gib
    assert abs(predicted / traced.tensors_gib - 1) < 0.05, (predicted, traced.as_dict())
