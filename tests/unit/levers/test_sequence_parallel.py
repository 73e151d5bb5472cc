"""Ulysses sequence parallelism's arithmetic, in process: the shards, the label shift across a cut, the
normalizer, the batch rule with N, and the refusals (docs/contracts.md, `distributed.sequence_parallel`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from config_helpers import config
from zerofit.config import load_config
from zerofit.core.errors import ConfigError
from zerofit.data import Example, collate
from zerofit.engine_spec import render_spec
from zerofit.levers.sequence_parallel import head_count_problem, shard_micro_batch
from zerofit.models.build import build_model, check_heads_before_load
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.resolution import resolve
from zerofit.token_loss.sums import IGNORE_INDEX, batch_labels, count_label_tokens, token_sum_loss

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the demo config names its data relative to the checkout


def _ragged_batch() -> dict[str, torch.Tensor]:
    """Two examples of 7 and 4 tokens (prompt tokens masked), right-padded to 7."""
    examples = [
        Example(input_ids=[1, 5, 6, 7, 8, 9, 10], labels=[IGNORE_INDEX, IGNORE_INDEX, 6, 7, 8, 9, 10]),
        Example(input_ids=[1, 11, 12, 13], labels=[IGNORE_INDEX, 11, 12, 13]),
    ]
    return collate(examples, pad_id=0)


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_shards_partition_the_shifted_labels_and_the_tokens(sp: int) -> None:
    batch = _ragged_batch()
    shards = [shard_micro_batch(batch, sp, r, rows=3, pad_id=0) for r in range(sp)]
    width = -(-7 // sp) * sp
    for shard in shards:
        assert {k: tuple(v.shape) for k, v in shard.items()} == dict.fromkeys(
            ("input_ids", "attention_mask", "shift_labels", "position_ids"), (3, width // sp)
        )
    joined = {k: torch.cat([s[k] for s in shards], dim=1) for k in shards[0]}
    # Position t's target is label t+1, also where t is the last position of one shard.
    expected = torch.full((3, width), IGNORE_INDEX)
    expected[:2, :6] = batch["labels"][:, 1:]
    assert torch.equal(joined["shift_labels"], expected)
    assert torch.equal(joined["input_ids"][:2, :7], batch["input_ids"])
    assert torch.equal(joined["position_ids"], torch.arange(width).expand(3, width))  # global positions
    # Every valid label counted exactly once in the group; padding rows and columns count nothing.
    assert sum(count_label_tokens(*batch_labels(s)) for s in shards) == count_label_tokens(batch["labels"])
    assert sum(int(s["attention_mask"].sum()) for s in shards) == int(batch["attention_mask"].sum())


@pytest.mark.parametrize("impl", ["chunked", "unchunked"])
def test_shard_token_sums_add_up_to_the_whole_sequence(impl: str) -> None:
    """The group's shard losses (each from its own positions' logits) sum to the unsharded token sum, so
    dividing by the global count gives the one-process loss."""
    batch, sp = _ragged_batch(), 2
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 17, dtype=torch.float64)  # 7 positions, padded to 8
    whole = token_sum_loss(logits[:, :7], batch["labels"], impl)
    parts = []
    for r in range(sp):
        shard = shard_micro_batch(batch, sp, r, rows=2, pad_id=0)
        labels, shifted = batch_labels(shard)
        parts.append(token_sum_loss(logits[:, r * 4 : (r + 1) * 4], labels, impl, shifted))
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-12)


def test_the_batch_rule_counts_dp_as_world_over_n() -> None:
    resolved = resolve(load_config(DEMO, ["distributed.sequence_parallel=2", "batch.micro_batch_size=2"]), 4)
    assert (resolved.batch.dp_size, resolved.batch.grad_accum_steps) == (2, 4)  # 16 = 2 x 4 x dp 2
    spec = render_spec(resolved)
    # DeepSpeed counts its batch over world / sequence_parallel ranks and divides gradients by that.
    assert spec.to_json()["train_batch_size"] == 16 and spec.grad_divide_factor == 2.0
    assert spec.sequence_parallel == 2


@pytest.mark.parametrize(
    ("overrides", "world", "says"),
    [
        (["distributed.strategy=fsdp", "distributed.preset=null"], 2, "distributed.strategy=deepspeed"),
        (["distributed.strategy=ddp", "distributed.preset=null"], 2, "has none"),
        (["distributed.strategy=single", "distributed.preset=null"], 2, "'single' has none"),
        ([], 3, "must divide the world size (3 rank(s))"),
        (["batch.micro_batch_size=null", "batch.tokens_per_micro_batch=128"], 2, "batch.micro_batch_size"),
        (["train.objective=dpo"], 2, "train.objective = 'sft' only"),
        (["model.attn_implementation=eager"], 2, "model.attn_implementation=sdpa"),
    ],
)
def test_unsupported_combinations_are_refused(overrides: list[str], world: int, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(load_config(DEMO, ["distributed.sequence_parallel=2", *overrides]), world)
    assert "distributed.sequence_parallel = 2" in str(err.value) and says in str(err.value)


def test_head_counts_that_do_not_split_are_refused_before_the_weights_load() -> None:
    assert head_count_problem(32, 8, 4) is None and head_count_problem(32, 2, 4) is None  # kv replicated
    assert "one of [2, 4]" in (head_count_problem(4, 2, 3) or "")
    # A catalogued model (tiny-llama: 4 heads) is refused while the config resolves (`zerofit plan` too).
    with pytest.raises(ConfigError, match="4 attention heads and 2 key/value heads"):
        resolve(load_config(DEMO, ["distributed.sequence_parallel=3", "batch.global_batch_size=12"]), 3)
    with pytest.raises(ConfigError) as err:  # the tiny model: 4 attention heads, 2 key/value heads
        check_heads_before_load(str(ensure_tiny_llama(0)), 3, trust_remote_code=False)
    assert "4 attention heads and 2 key/value heads" in str(err.value)
    check_heads_before_load(str(ensure_tiny_llama(0)), 2, trust_remote_code=False)


def test_build_model_refuses_the_head_count_before_any_weight_loads(tmp_path: Path) -> None:
    # A model folder with its config.json and no weights: the refusal comes from the config alone (a load
    # would fail on the missing weights instead).
    shutil.copy(ensure_tiny_llama(0) / "config.json", tmp_path / "config.json")
    cfg = config(
        {
            "model": {"name_or_path": str(tmp_path)},
            "distributed": {"strategy": "deepspeed", "sequence_parallel": 3},
        }
    )
    with pytest.raises(ConfigError, match="sequence_parallel = 3 splits the attention heads"):
        build_model(cfg)


# ----------------------------------------------------------------------------------------- the planner

LORA_LONG = REPO / "configs" / "llama31-8b-lora-longctx-3090.yaml"


def test_planner_shards_the_activations_and_adds_the_exchange() -> None:
    from zerofit.catalogue.gpus import GPUS
    from zerofit.planner.estimate import estimate, ulysses_buffer_bytes
    from zerofit.planner.scenario import what_if
    from zerofit.planner.speed import predict_speed, ulysses_transfer_s

    cfg = load_config(LORA_LONG, ["data.max_seq_len=16384", "batch.global_batch_size=4"])
    one, two = what_if(cfg, 1), what_if(cfg, 2, ["distributed.sequence_parallel=2"])
    assert (two.sequence_parallel, two.dp_size, two.zero_ranks, two.shard_seq_len) == (2, 1, 2, 8192)
    half = estimate(one.with_levers(seq_len=8192))
    sharded = estimate(two)
    acts = {k: v for k, v in sharded.breakdown.items() if k.startswith("activations:")}
    exchange = [v for k, v in acts.items() if "Ulysses all-to-all" in k]
    assert exchange and exchange[0] * 2**30 == pytest.approx(ulysses_buffer_bytes(two))
    # The rank's activations are those of its 8k-token shard, plus the exchange's buffers.
    half_acts = sum(v for k, v in half.breakdown.items() if k.startswith("activations:"))
    assert sum(acts.values()) == pytest.approx(half_acts + exchange[0], rel=1e-6)
    # The all-to-alls cost time, less over NVLink than over PCIe; none without sequence parallelism.
    assert ulysses_transfer_s(one, GPUS["rtx3090"]) == 0.0
    assert ulysses_transfer_s(two, GPUS["h200"]) < ulysses_transfer_s(two, GPUS["rtx3090"])
    rtx = predict_speed(two, GPUS["rtx3090"])
    no_comm = predict_speed(two, GPUS["rtx3090"]).step_time_s - ulysses_transfer_s(two, GPUS["rtx3090"])
    assert rtx.step_time_s > no_comm > 0


def test_max_context_grows_with_two_and_four_cards() -> None:
    from zerofit.planner.context import max_context
    from zerofit.planner.search.budget import resolve_budget

    reached = {}
    for sp in (1, 2, 4):
        cfg = load_config(LORA_LONG, [f"distributed.sequence_parallel={sp}"])
        budget = resolve_budget(cfg, gpu="rtx3090", detect=False)
        assert budget is not None
        found = max_context(cfg, sp, budget)
        assert found.tokens is not None
        reached[sp] = found.memory_tokens
    assert reached[2] > 1.5 * reached[1] and reached[4] > 1.5 * reached[2], reached
    assert any("sequence parallelism 4" in line for line in found.assumptions)


def test_a_sequence_too_long_for_one_card_gets_sequence_parallelism_as_its_remedy() -> None:
    from zerofit.planner.estimate import estimate
    from zerofit.planner.scenario import what_if
    from zerofit.planner.search.budget import resolve_budget
    from zerofit.planner.search.remedies import remedies

    cfg = load_config(LORA_LONG, ["data.max_seq_len=61440"])  # one card's longest is 38,912
    budget = resolve_budget(cfg, gpu="rtx3090", detect=False)
    assert budget is not None
    # On the 2 GPUs launched: more data-parallel ranks never shorten a rank's sequence; sharing it does.
    by_name = {r.name: r for r in remedies(cfg, 2, budget)}
    shared = by_name["sequence parallelism: 2 of the 2 GPUs share each sequence"]
    assert shared.verdict == "fits" and shared.how.split()[0] == "distributed.sequence_parallel=2"
    # Typed as shown (with the levers it needs at that length), it is the run that fits.
    typed = [*shared.how.split(), f"batch.micro_batch_size={shared.micro_batch_size}"]
    scn = what_if(load_config(LORA_LONG, ["data.max_seq_len=61440", *typed]), 2)
    assert scn.sequence_parallel == 2 and estimate(scn).total_gib == pytest.approx(shared.total_gib)
    assert estimate(scn).total_gib <= budget.limit_gib
    # On one GPU: 2 with ZeRO-3 data parallelism would not fit, 2 sharing the sequence do.
    more = [r for r in remedies(cfg, 1, budget) if r.name.startswith("more GPUs")]
    assert [r.name for r in more] == ["more GPUs: 2 with sequence parallelism 2"]
    assert "deepspeed --num_gpus 2" in more[0].how and "distributed.sequence_parallel=2" in more[0].how


def test_a_sequence_parallel_checkpoint_resumes_only_on_its_world_size(tmp_path: Path) -> None:
    from zerofit.checkpoint.resume import _check_sequence_parallel_world
    from zerofit.core.errors import ResumeError

    saved = resolve(load_config(DEMO, ["distributed.sequence_parallel=2"]), 2).config.model_dump(mode="json")
    manifest = {"world_size": 2, "config": saved}
    for world, sp in ((2, 1), (2, 2)):  # another N (and dp) on the same ranks: DeepSpeed loads it directly
        _check_sequence_parallel_world(
            tmp_path, manifest, resolve(load_config(DEMO, [f"distributed.sequence_parallel={sp}"]), world)
        )
    with pytest.raises(ResumeError, match="resumes on the same number of ranks"):
        _check_sequence_parallel_world(tmp_path, manifest, resolve(load_config(DEMO), 1))


@pytest.mark.parametrize(
    ("preset", "factor"), [("zero0", 2.0), ("zero1", 2.0), ("zero2", 2.0), ("zero3", 4.0)]
)
def test_the_divide_factor_is_what_deepspeed_divides_by(preset: str, factor: float) -> None:
    """dp = 2 on 4 ranks with N = 2: ZeRO-0/1/2 divide by world / N, ZeRO-3's reduce-scatter by the world."""
    overrides = [
        "distributed.sequence_parallel=2",
        f"distributed.preset={preset}",
        "batch.micro_batch_size=2",
    ]
    assert render_spec(resolve(load_config(DEMO, overrides), 4)).grad_divide_factor == factor
    plain = ["distributed.sequence_parallel=1", f"distributed.preset={preset}", "batch.micro_batch_size=2"]
    assert render_spec(resolve(load_config(DEMO, plain), 4)).grad_divide_factor == 4.0  # dp 4 = world


def test_zero3_without_reduce_scatter_is_refused(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "reduce_scatter": false}}')
    overrides = ["distributed.sequence_parallel=2", f"distributed.ds_config={ds}", "distributed.preset=null"]
    with pytest.raises(ConfigError, match=r"needs zero_optimization\.reduce_scatter = true"):
        render_spec(resolve(load_config(DEMO, overrides), 2))
