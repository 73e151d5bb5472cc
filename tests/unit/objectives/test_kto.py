"""KTO (`zerofit.objectives.kto.loss`): the loss by hand, exactness over any split, and what a per-micro-batch
reference point would change."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.data import IGNORE_INDEX, Example
from zerofit.data.unpaired import UnpairedExample, collate_unpaired, kto_micro_batches, mismatched
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.kto.loss import KTO_METRICS, KTOObjective, KTOSettings, kto_losses
from zerofit.objectives.logps import adapters_disabled, row_logps
from zerofit.token_loss.sums import token_losses

SEED, VOCAB = 3, 128
SETTINGS = KTOSettings(beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)


def lora_tiny(seed: int = 0) -> torch.nn.Module:
    """The tiny Llama in fp32 with LoRA adapters that change its output (lora_B drawn from `seed`, not zero)."""
    from transformers import AutoModelForCausalLM

    from zerofit.models.lora import apply_lora, lora_config

    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(SEED), dtype=torch.float32)
    spec = lora_config(r=4, alpha=8, dropout=0.0, target_modules="all-linear", use_dora=False)
    model = apply_lora(base, spec, seed=seed)  # lora_A drawn reproducibly too
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def unit(i: int, desirable: bool, max_seq_len: int = 64) -> UnpairedExample:
    """Prompt of 2..6 tokens, a completion of 1..7 tokens (ragged), the label given."""
    g = torch.Generator().manual_seed(100 + i)
    prompt = [1, *torch.randint(3, VOCAB, (2 + i % 5,), generator=g).tolist()]
    completion = [*torch.randint(3, VOCAB, (1 + (3 * i) % 7,), generator=g).tolist(), 2]
    return UnpairedExample(
        Example(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion),
        len(prompt),
        desirable,
        max_seq_len,
    )


LABELS = (True, False, True, True, False, True, False, False)


def test_kto_losses_by_hand() -> None:
    """Two examples, r = (1.0, -2.0), z0 = 0.4, beta 0.5, weights 1 and 1.5."""
    r = torch.tensor([1.0, -2.0])
    losses = kto_losses(r, torch.tensor([True, False]), 0.4, SETTINGS)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert losses.tolist() == pytest.approx([1 - sig(0.5 * 0.6), 1.5 * (1 - sig(0.5 * 2.4))], abs=1e-7)


def test_mismatched_pairs_rotate_over_the_global_batch_whatever_the_split() -> None:
    units = [unit(i, LABELS[i]) for i in range(5)]
    order = [3, 0, 4, 1, 2]  # the sampler's order
    whole = kto_micro_batches(units, order, 5, 1, 1, 0, 0)[0]
    expected = collate_unpaired([units[k] for k in order], [units[k] for k in [2, 3, 0, 4, 1]], 0)
    assert torch.equal(whole["kl_input_ids"], expected["kl_input_ids"])
    # the same rows, cut into micro-batches of 2 over 2 ranks x 2 accumulation steps (one of them short)
    rows = [b for r in (0, 1) for b in kto_micro_batches(units, order, 2, 2, 2, r, 0)]
    got = sorted(tuple(x for x in row.tolist() if x) for b in rows for row in b["kl_input_ids"])
    want = sorted(tuple(x for x in row.tolist() if x) for row in expected["kl_input_ids"])
    assert got[1:] == want or got == want  # one rank's last micro-batch is the empty dummy row
    assert (
        mismatched(units[0], units[1]).input_ids
        == units[0].input_ids[: units[0].prompt_len] + units[1].input_ids[units[1].prompt_len :]
    )


def _direct(model: torch.nn.Module, example: Example) -> float:
    """pi - ref summed completion log-prob of one sequence, straight from the logits."""
    ids = torch.tensor([example.input_ids])
    labels = torch.tensor([example.labels])
    with torch.no_grad():
        pi = row_logps(token_losses(model(input_ids=ids).logits, labels), labels)[0]
        with adapters_disabled(model):
            ref = row_logps(token_losses(model(input_ids=ids).logits, labels), labels)[0]
    return float(pi - ref)


def test_the_objective_is_the_formula_on_a_hand_made_batch() -> None:
    """z0 from the rotated completions, then the mean weighted loss, computed example by example."""
    model = lora_tiny()
    units = [unit(i, LABELS[i]) for i in range(4)]
    objective = KTOObjective(SETTINGS)
    batch = kto_micro_batches(units, [0, 1, 2, 3], 4, 1, 1, 0, 0)[0]
    z0 = objective.estimate_reference_point(one_process_strategy(), model, [batch], "chunked")
    kl = [_direct(model, mismatched(units[k], units[(k - 1) % 4])) for k in range(4)]
    assert z0 == pytest.approx(max(sum(kl) / 4, 0.0), abs=1e-5)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        (loss_sum,), _ = objective.terms(model, inputs, batch, "chunked")
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    by_hand = 0.0
    for u in units:
        r = _direct(model, u.example)
        by_hand += (1 - sig(0.5 * (r - z0))) if u.desirable else 1.5 * (1 - sig(0.5 * (z0 - r)))
    assert float(loss_sum) / 4 == pytest.approx(by_hand / 4, abs=1e-5)


# -- one global batch, any split: the same loss curve ---------------------------------------------------


def _curve(
    model: torch.nn.Module, units: list[UnpairedExample], micro: int, steps: int = 3
) -> list[dict[str, Any]]:
    """`steps` train_steps (SGD lr 0.5) of the global batch of all `units` in micro-batches of `micro`."""
    model = copy.deepcopy(model)
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    objective = KTOObjective(SETTINGS)
    order = list(range(len(units)))
    out = []
    for _ in range(steps):
        batches = kto_micro_batches(units, order, micro, len(units) // micro, 1, 0, 0)
        result = train_step(strategy, model, batches, None, "chunked", objective)
        out.append({"loss": result.loss, **result.metrics})
    return out


@pytest.fixture(scope="module")
def model_and_units() -> tuple[torch.nn.Module, list[UnpairedExample]]:
    return lora_tiny(seed=2), [unit(i, LABELS[i]) for i in range(8)]  # adapters with z0 > 0 on these


@pytest.mark.slow  # three steps twice: ~6 s alone on 2 cores
def test_8x1_and_2x4_give_the_same_fp32_loss_curve(
    model_and_units: tuple[torch.nn.Module, list[UnpairedExample]],
) -> None:
    model, units = model_and_units
    one, split = _curve(model, units, 8), _curve(model, units, 2)
    assert one[0]["loss"] != pytest.approx(one[-1]["loss"], abs=1e-4)  # the steps did something
    assert max(row["kl"] for row in one) > 1e-3  # and z0 was not clamped to 0 throughout
    for a, b in zip(one, split, strict=True):
        assert set(a) == set(KTO_METRICS) | {"loss"}
        assert b == pytest.approx(a, abs=2e-5)


def test_a_per_micro_batch_reference_point_and_mean_disagree(
    model_and_units: tuple[torch.nn.Module, list[UnpairedExample]],
) -> None:
    """TRL's way at accumulation 4: each micro-batch of 2 its own rotation, z0 and mean, averaged over
    the accumulation steps: not the global batch's loss (which ours is, for any split)."""
    model, units = model_and_units
    ours = _curve(model, units, 2, steps=1)[0]["loss"]
    objective, naive = KTOObjective(SETTINGS), 0.0
    strategy = one_process_strategy()
    for k in range(0, 8, 2):
        batch = kto_micro_batches(units, [k, k + 1], 2, 1, 1, 0, 0)[0]
        objective.estimate_reference_point(strategy, model, [batch], "chunked")
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with torch.no_grad():
            (loss_sum,), _ = objective.terms(model, inputs, batch, "chunked")
        naive += float(loss_sum) / 2 / 4
    assert abs(naive - ours) > 1e-3, (naive, ours)


# -- TRL's KTOTrainer, accumulation 1 -------------------------------------------------------------------

RECORDS = [
    ("add: 2+3\n", "5", True),
    ("copy: abc\n", "&*", False),
    ("reverse: xyz\n", "zyx", True),
    ("upper: qq\n", "QQ", True),
    ("add: 10+7\n", "!!#", False),
    ("copy: hello\n", "hello", True),
    ("reverse: ab\n", "@", False),
    ("upper: kto\n", "?^~$", False),
]


@pytest.mark.slow  # importing TRL and building its trainer take seconds
def test_the_loss_equals_trls_kto_trainer_at_accumulation_1(tmp_path: Any) -> None:
    """TRL's KTOTrainer (its own tokenization and collator; the reference model given as the base, since TRL
    handed a PeftModel without one keeps a copy of its adapter as the reference, which is the base only for a
    fresh adapter) on one batch of 8 = the whole data at accumulation 1, one device: its `compute_loss` equals ours on the
    same token ids as one global batch. Definitional differences, none of which this setting exercises: TRL
    pairs mismatched completions within each `per_device_train_batch_size` chunk of the dataset (ours: within
    the global batch, in the sampler's order) and estimates z0 and the mean per device micro-batch (ours:
    over the global batch, whatever the split); so the two agree when one micro-batch is the global batch."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_llama(SEED))
    rows = {
        "prompt": [r[0] for r in RECORDS],
        "completion": [r[1] for r in RECORDS],
        "label": [r[2] for r in RECORDS],
    }
    args = KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=1.5,
        max_length=64,
        report_to=[],
        use_cpu=True,
        bf16=False,  # fp32 throughout (accelerate would wrap the reference's forward in bf16 autocast)
        seed=SEED,
    )
    ours_model = lora_tiny(seed=7)  # adapters whose mismatched KL on this data is above 0 (z0 not clamped)
    trainer = KTOTrainer(
        model=copy.deepcopy(ours_model),
        ref_model=AutoModelForCausalLM.from_pretrained(
            ensure_tiny_llama(SEED), dtype=torch.float32
        ),  # the base
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model, batch))
    data = trainer.train_dataset
    units = [
        UnpairedExample(Example(p + c, [IGNORE_INDEX] * len(p) + c), len(p), bool(label), 64)
        for p, c, label in zip(data["prompt_ids"], data["completion_ids"], data["label"], strict=True)
    ]
    objective = KTOObjective(SETTINGS)
    ours = kto_micro_batches(units, list(range(8)), 8, 1, 1, 0, int(tokenizer.pad_token_id))[0]
    objective.estimate_reference_point(one_process_strategy(), ours_model, [ours], "chunked")
    inputs = {"input_ids": ours["input_ids"], "attention_mask": ours["attention_mask"]}
    with torch.no_grad():
        (loss_sum,), _ = objective.terms(ours_model, inputs, ours, "chunked")
    assert objective.z0 > 1e-3
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(objective.z0, abs=1e-6)
    assert float(loss_sum) / 8 == pytest.approx(trl_loss, abs=1e-6)


def test_the_evaluation_is_the_same_for_any_micro_batch(
    model_and_units: tuple[torch.nn.Module, list[UnpairedExample]],
) -> None:
    """`eval/*` over 7 held-out examples (a short last window): micro 1 and micro 4 agree, and eval/loss is
    the objective's loss of them all as one global batch."""
    from zerofit.loop.unpaired import kto_evaluation

    model, units = model_and_units
    held = units[:7]
    strategy = one_process_strategy()
    strategy.prepare(
        copy.deepcopy(model),
        lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.0),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    one, four = (kto_evaluation(strategy, model, held, KTOObjective(SETTINGS), micro, 0) for micro in (1, 4))
    assert four == pytest.approx(one, abs=1e-5)  # logps: sums of ~20 nats, padded differently
    assert one["eval/examples"] == 7 and {f"eval/{k}" for k in KTO_METRICS} <= set(one)
    objective = KTOObjective(SETTINGS)
    batch = kto_micro_batches(held, list(range(7)), 7, 1, 1, 0, 0)[0]
    z0 = objective.estimate_reference_point(strategy, model, [batch], "chunked")
    assert z0 == pytest.approx(one["eval/kl"], abs=1e-5)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        (loss_sum,), _ = objective.terms(model, inputs, batch, "chunked")
    assert one["eval/loss"] == pytest.approx(float(loss_sum) / 7, abs=1e-5)


def test_the_gpu_probe_measures_a_kto_step() -> None:
    """`zerofit plan --probe` feeds a KTO micro-batch of m rows with their KL rows: one train_step runs on it
    (the KL pass, the reference and the policy forward)."""
    from zerofit.config import load_config
    from zerofit.objectives.registry import objective_named

    cfg = load_config(None, ["train.objective=kto"])
    batch = objective_named("kto").synthetic_batch(3, 16, VOCAB, 0, cfg)
    assert batch["input_ids"].shape == batch["kl_input_ids"].shape == (3, 16) and int(batch["examples"]) == 3
    model = lora_tiny()
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    result = train_step(strategy, model, [batch], None, "chunked", KTOObjective(SETTINGS))
    assert math.isfinite(result.loss) and {"rewards/chosen", "rewards/rejected", "kl"} <= set(result.metrics)
