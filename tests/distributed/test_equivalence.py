"""One global batch, any split, any engine: the same training (docs/design.md, "Gradient accumulation").

A tiny Llama, full fine-tuning in fp32 (so every parameter is compared, not only adapters), data whose
lengths vary from 1 to ~60 tokens, global batch 8 split as

    (micro 8, GAS 1, single)  (micro 2, GAS 4, single)  (micro 2, GAS 2, dp 2) on DeepSpeed ZeRO-0/2/3
    (micro 1, GAS 4, dp 2) on FSDP2, and (micro 2, GAS 2, dp 2) on plain DDP
    (micro 2, GAS 2, dp 2) on ZeRO-2 and ZeRO-3 with the loss inside lm_head (train.cross_entropy=fused_linear)
    the reference (micro 8) on transformers' dense-mask sdpa, every other split on the varlen path
    (model.attn_implementation: auto, zerofit.levers.attention) for its padded micro-batches and packed rows
    token budgets (batch.tokens_per_micro_batch, examples packed into 64-token rows): 2 rows per
    micro-batch on ZeRO-2 and 1 row on FSDP2, dp 2 (a rank runs as many micro-steps as the packing needs)
    the memory levers: packed on ZeRO-2 with every layer checkpointed, its input offloaded, its MLP
    in 3 token shards and lean RMSNorms, every layer compiled (train.compile, inside its checkpoint); ZeRO-3 with the MLP in 2 token shards and lean RMSNorms

the one-process references through the Python API (`zerofit.train`, in the test process), one run per engine
family through the real launcher (ZeRO-2 and FSDP2 under torchrun; gloo), the rest of the matrix, the levers'
run included (what it tests is the levers on ZeRO-2, not its launcher), `warm` (tests/warm_launch.py):
the DeepSpeed runs under `torchrun` or warm (zerofit runs
DeepSpeed under either; the `deepspeed` runner's own start-up, ~5 CPU-s a launch, is exercised by the
modules about it: test_engines, test_stop_resume, test_failures, test_multinode_export). Over 4 optimizer steps the per-step losses
(metrics.jsonl) and the exported final parameters agree within 1e-5. The same runs show: clipping is
active (pre-clip grad norm > max_grad_norm, logged) yet the splits agree, so it happens once after the
window; the LR follows the schedule once per optimizer step; the short window at the end of the epoch
(train.partial_window=normalize, with empty micro-batches on some ranks) is normalized by its own tokens.
The companion test shows that per-micro-batch means divided by GAS would not agree on this data. Tool-calling
conversations (the bundled demo, tiny-qwen2) agree too: one big batch vs FSDP2 over 2 ranks.

    launch            launcher   engine                split (micro x accum x dp)   what
    single-m8         api        one process           8 x 1 x 1         the reference, transformers' sdpa
    single-m2         api        one process           2 x 4 x 1         varlen attention from here on
    zero0             warm       DeepSpeed ZeRO-0      2 x 2 x 2
    zero2             torchrun   DeepSpeed ZeRO-2      2 x 2 x 2
    zero3             warm       DeepSpeed ZeRO-3      2 x 2 x 2
    fsdp              torchrun   FSDP2                 1 x 4 x 2
    ddp               warm       DDP                   2 x 2 x 2
    zero2-packed      warm       DeepSpeed ZeRO-2      2 rows x 2 x 2    128-token budgets, 64-token rows
    fsdp-packed       warm       FSDP2                 1 row x 4 x 2     64-token budgets
    zero2-levers      warm       DeepSpeed ZeRO-2      2 rows x 2 x 2    checkpointing + offload, tiled MLP 3,
                                                                         lean norms, fused loss, compile
    zero3-tiled       warm       DeepSpeed ZeRO-3      2 x 2 x 2         tiled MLP 2, lean norms, fused loss
    tools-single-m8   api        one process           8 x 1 x 1         tool-calling chats: the reference
    tools-fsdp        warm       FSDP2                 1 x 4 x 2         tool-calling chats
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from launch_helpers import Launch, RunResult, run_launches, varied_length_data, write_config
from zerofit.data import GlobalBatchSampler, collate, load_sft_dataset
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.strategies.optim import lr_multiplier
from zerofit.token_loss.sums import count_label_tokens, token_sum_loss

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

N_EXAMPLES, GLOBAL, STEPS, SEED, LR, MAX_LEN, CLIP = 20, 8, 4, 7, 1e-3, 64, 1.0
TOL = 1e-5
FUSED = "train.cross_entropy=fused_linear"

LEVERS = (
    "train.tiled_mlp=3",
    "train.activation_checkpointing=true",
    "train.activation_offload=true",
    "train.lean_norm=true",
)
SPLITS = [
    # The reference runs transformers' own sdpa (a dense mask for its padded micro-batch); every other launch
    # takes model.attn_implementation's default, auto: varlen for its padded micro-batches and packed rows.
    Launch(
        "single-m8",
        "api",
        ("distributed.strategy=single", "batch.micro_batch_size=8", "model.attn_implementation=sdpa"),
    ),
    Launch("single-m2", "api", ("distributed.strategy=single", "batch.micro_batch_size=2")),
    Launch("zero0", "warm", ("distributed.preset=zero0", "batch.micro_batch_size=2")),
    Launch("zero2", "torchrun", ("distributed.preset=zero2", "batch.micro_batch_size=2")),
    Launch("zero3", "warm", ("distributed.preset=zero3", "batch.micro_batch_size=2")),
    Launch("fsdp", "torchrun", ("distributed.strategy=fsdp", "batch.micro_batch_size=1")),
    Launch("ddp", "warm", ("distributed.strategy=ddp", "batch.micro_batch_size=2")),
    Launch("zero2-packed", "warm", ("distributed.preset=zero2", "batch.tokens_per_micro_batch=128")),
    Launch("fsdp-packed", "warm", ("distributed.strategy=fsdp", "batch.tokens_per_micro_batch=64")),
    # The memory levers on ZeRO-2, packed rows: every layer checkpointed with its input offloaded,
    # every MLP in 3 token shards, the loss inside lm_head (no logits), each decoder layer compiled (a speed
    # lever: compile inside the checkpoint, the offload hooks outside it, under ZeRO-2's gradient hooks); ZeRO-3 with the tiled MLP (its MLP a
    # ZeRO-3 leaf module) and the fused loss (lm_head's weight gathered by the module's hooks).
    Launch(
        "zero2-levers",
        "warm",
        (
            "distributed.preset=zero2",
            "batch.tokens_per_micro_batch=128",
            *LEVERS,
            FUSED,
            "train.compile=true",
        ),
    ),
    Launch(
        "zero3-tiled",
        "warm",
        (
            "distributed.preset=zero3",
            "batch.micro_batch_size=2",
            "train.tiled_mlp=2",
            "train.lean_norm=true",
            FUSED,
        ),
    ),
]
# Tool-calling conversations: tiny-qwen2's real Qwen2.5 template with tools, calls and results, the
# bundled demo data (~900-1200 tokens each, ragged): one big batch on one process vs FSDP2, micro 1 x GAS 4 x dp 2.
TOOLS = (
    "model.name_or_path=tiny-qwen2",
    f"data.path={Path(__file__).resolve().parents[2] / 'data' / 'demo_tools.jsonl'}",
    "data.max_seq_len=1280",
)
TOOL_SPLITS = [
    Launch(
        "tools-single-m8",
        "api",
        ("distributed.strategy=single", "batch.micro_batch_size=8", "model.attn_implementation=sdpa", *TOOLS),
    ),
    Launch("tools-fsdp", "warm", ("distributed.strategy=fsdp", "batch.micro_batch_size=1", *TOOLS)),
]
EXPECTED_SPLIT = {  # (micro, GAS, dp) as logged
    "single-m8": (8, 1, 1),
    "single-m2": (2, 4, 1),
    "zero0": (2, 2, 2),
    "zero2": (2, 2, 2),
    "zero3": (2, 2, 2),
    "fsdp": (1, 4, 2),
    "ddp": (2, 2, 2),
    "zero2-packed": (2, 2, 2),  # rows per micro-batch, the most micro-steps, dp
    "fsdp-packed": (1, 4, 2),
    "zero2-levers": (2, 2, 2),
    "zero3-tiled": (2, 2, 2),
    "tools-single-m8": (8, 1, 1),
    "tools-fsdp": (1, 4, 2),
}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return varied_length_data(tmp_path_factory.mktemp("data") / "varied.jsonl", N_EXAMPLES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_file: Path) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("equivalence")
    config = write_config(
        root / "equivalence.yaml",
        {
            "seed": SEED,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": GLOBAL},
            "distributed": {"strategy": "deepspeed"},
            "train": {
                "max_steps": STEPS,
                "precision": "fp32",
                "max_grad_norm": CLIP,
                "partial_window": "normalize",
            },
            "optimizer": {"lr": LR},
            "scheduler": {"name": "cosine", "warmup_steps": 1},
            "lora": {"enabled": False},
            "data": {"path": str(data_file), "max_seq_len": MAX_LEN},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    results = run_launches([*SPLITS, *TOOL_SPLITS], config, root / "runs")
    for result in results.values():
        result.check()
    return results


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", [launch.name for launch in (*SPLITS, *TOOL_SPLITS)])
def test_split_is_what_was_asked(runs: dict[str, RunResult], name: str) -> None:
    rows = runs[name].metrics
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert (row["micro_batch_size"], row["grad_accum_steps"], row["dp_size"]) == EXPECTED_SPLIT[name]


@pytest.mark.parametrize("name", [launch.name for launch in SPLITS[1:]])
def test_losses_and_tokens_agree_with_one_big_batch(runs: dict[str, RunResult], name: str) -> None:
    ref, run = runs["single-m8"], runs[name]
    assert run.series("tokens") == ref.series("tokens")
    assert _max_diff(run.series("loss"), ref.series("loss")) < TOL, (run.series("loss"), ref.series("loss"))


def test_tool_calling_conversations_agree_over_two_ranks(runs: dict[str, RunResult]) -> None:
    """fp32 SFT on ragged tool-calling data (assistant tool calls learned, tool results masked): FSDP2 over 2
    ranks gives one big batch's tokens and losses within 2e-5 (the in-process 8 x 1 vs 2 x 4 check and the
    per-micro-batch mean that disagrees are in tests/unit/data/test_tools.py)."""
    ref, run = runs["tools-single-m8"], runs["tools-fsdp"]
    assert run.series("tokens") == ref.series("tokens")
    assert _max_diff(run.series("loss"), ref.series("loss")) < 2e-5, (run.series("loss"), ref.series("loss"))


def test_the_lever_runs_ran_with_their_levers(runs: dict[str, RunResult]) -> None:
    """The lever launches agree with one big batch (tests above) with the levers on, as config.yaml says."""
    import yaml

    levers = yaml.safe_load((runs["zero2-levers"].run_dir / "config.yaml").read_text())["train"]
    assert (levers["tiled_mlp"], levers["activation_checkpointing"], levers["activation_offload"]) == (
        3,
        True,
        True,
    )
    tiled = yaml.safe_load((runs["zero3-tiled"].run_dir / "config.yaml").read_text())["train"]
    assert tiled["tiled_mlp"] == 2
    assert levers["lean_norm"] is tiled["lean_norm"] is True
    assert levers["cross_entropy"] == tiled["cross_entropy"] == "fused_linear"
    assert levers["compile"] is True and tiled["compile"] is False
    # The tiled MLP's RNG-state calls break the compiled layers' graphs: counted in every row.
    assert all(row["compile/graph_breaks"] > 0 for row in runs["zero2-levers"].metrics)


def test_the_reference_ran_sdpa_and_the_packed_runs_varlen(runs: dict[str, RunResult]) -> None:
    """The launches above agree with the dense-mask sdpa reference while the packed ones (ZeRO-2 and FSDP2
    over 2 ranks, ragged rows) ran the varlen path (zerofit.levers.attention), as config.yaml records."""
    import yaml

    def attn(name: str) -> str:
        return yaml.safe_load((runs[name].run_dir / "config.yaml").read_text())["model"][
            "attn_implementation"
        ]

    assert attn("single-m8") == "sdpa"
    assert attn("zero2-packed") == attn("fsdp-packed") == attn("zero2-levers") == attn("zero2") == "varlen"


def test_packed_runs_computed_less_padding(runs: dict[str, RunResult]) -> None:
    """The token budget packs the same examples into fewer processed positions (padding is what it saves)."""
    padded, packed = runs["zero2"], runs["zero2-packed"]
    assert packed.series("tokens") == padded.series("tokens")
    # (The partial window is left out: there the padded run's empty micro-batches count a pad token each.)
    full_windows = [
        (a, b) for a, b in zip(padded.metrics, packed.metrics, strict=True) if not a["partial_window"]
    ]
    assert len(full_windows) == STEPS - 1
    for a, b in full_windows:
        processed = (
            a["processed_tokens_per_s"] * a["step_time_s"],
            b["processed_tokens_per_s"] * b["step_time_s"],
        )
        useful = (a["useful_tokens_per_s"] * a["step_time_s"], b["useful_tokens_per_s"] * b["step_time_s"])
        assert useful[0] == pytest.approx(useful[1], rel=1e-6) and processed[1] < processed[0]


@pytest.mark.parametrize("name", [launch.name for launch in SPLITS[1:]])
def test_final_parameters_agree_with_one_big_batch(runs: dict[str, RunResult], name: str) -> None:
    ref, other = runs["single-m8"].exported(), runs[name].exported()
    assert set(other) == set(ref)
    worst = max(float((other[k].float() - ref[k].float()).abs().max()) for k in ref)
    assert worst < TOL, f"{name}: max |param diff| = {worst:.3g}"


def test_training_moved_the_parameters(runs: dict[str, RunResult]) -> None:
    """Agreement is not two untouched copies of the initial weights."""
    from safetensors.torch import load_file

    initial = load_file(ensure_tiny_llama(SEED) / "model.safetensors")
    final = runs["single-m8"].exported()
    assert max(float((final[k] - initial[k]).abs().max()) for k in initial) > 1e-4


@pytest.mark.parametrize("name", [launch.name for launch in SPLITS])
def test_grad_norm_is_pre_clip_and_split_independent(runs: dict[str, RunResult], name: str) -> None:
    norms, ref = runs[name].series("grad_norm"), runs["single-m8"].series("grad_norm")
    # Clipping is active on every step (the logged norm is the one before clipping), and the splits still
    # agree on loss and parameters (tests above): one clip after the whole window, not one per micro-step.
    assert min(norms) > CLIP
    assert _max_diff(norms, ref) < TOL * max(ref)


@pytest.mark.parametrize("name", [launch.name for launch in SPLITS])
def test_lr_steps_once_per_optimizer_step(runs: dict[str, RunResult], name: str) -> None:
    factor = lr_multiplier("cosine", 1, STEPS, 0.0)
    expected = [LR * factor(step) for step in range(STEPS)]
    assert runs[name].series("lr") == pytest.approx(expected, rel=1e-9)


def _examples(data_file: Path) -> tuple[list[Any], int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_llama(SEED))
    examples, _ = load_sft_dataset(data_file, tokenizer, MAX_LEN)
    return examples, int(tokenizer.pad_token_id)


def test_partial_window_is_normalized_by_its_own_tokens(runs: dict[str, RunResult], data_file: Path) -> None:
    examples, pad = _examples(data_file)
    sampler = GlobalBatchSampler(len(examples), GLOBAL, SEED, partial_window="normalize")
    assert sampler.steps_per_epoch == 3  # 8 + 8 + the short window of 4
    expected_tokens = [
        count_label_tokens(collate([examples[i] for i in sampler.batch_indices(s)], pad)["labels"])
        for s in range(STEPS)
    ]
    for name in (launch.name for launch in SPLITS):  # the tool-calling launches read other data
        rows = runs[name].metrics
        assert [row["partial_window"] for row in rows] == [False, False, True, False]
        assert [row["epoch"] for row in rows] == [0, 0, 0, 1]  # the short window never leaks into epoch 1
        assert [row["tokens"] for row in rows] == expected_tokens


def test_per_micro_batch_means_would_not_agree(data_file: Path) -> None:
    """On this data, the common mistake (mean per micro-batch, divided by GAS) gives a different gradient;
    the token-sum normalization gives the one-big-batch gradient. So the equivalence tests can fail."""
    from transformers import AutoModelForCausalLM

    examples, pad = _examples(data_file)
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(SEED), dtype=torch.float32)
    indices = GlobalBatchSampler(len(examples), GLOBAL, SEED).batch_indices(0)
    full = collate([examples[i] for i in indices], pad)
    micro = [collate([examples[i] for i in indices[k : k + 2]], pad) for k in range(0, GLOBAL, 2)]

    def gradient(losses: list[torch.Tensor]) -> torch.Tensor:
        model.zero_grad()
        for loss in losses:
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def sum_and_count(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return token_sum_loss(logits, batch["labels"]), count_label_tokens(batch["labels"])

    total, n = sum_and_count(full)
    reference = gradient([total / n])
    window_tokens = sum(count_label_tokens(b["labels"]) for b in micro)
    ours = gradient([sum_and_count(b)[0] / window_tokens for b in micro])
    naive = gradient([(lambda s, c: s / c)(*sum_and_count(b)) / len(micro) for b in micro])

    assert float((ours - reference).abs().max()) < 1e-6
    relative_error = float((naive - reference).norm() / reference.norm())
    assert relative_error > 0.05, f"naive per-micro-batch means differ by only {relative_error:.3g}"
