"""Preference objectives in one process: per-token log-probs, the losses, split independence,
the adapters-off reference, and a tiny model learning an easy preference.

Real components: the built-in tiny Llama (transformers), peft's LoRA, zerofit's SingleStrategy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from config_helpers import one_process_strategy
from zerofit.config import load_config
from zerofit.data import IGNORE_INDEX, Example
from zerofit.data.pairs import PreferencePair, collate_pairs
from zerofit.loop.train import train_step
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.logps import adapters_disabled, row_logps
from zerofit.objectives.pairwise.loss import METRICS
from zerofit.objectives.protocol import Objective
from zerofit.objectives.registry import objective_named
from zerofit.token_loss.fused import fused_linear_token_sum, install_fused_head
from zerofit.token_loss.sums import shifted_targets, token_losses

SEED, VOCAB = 3, 128


def _tiny() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(SEED), dtype=torch.float32)


def _pair(i: int, chosen_token: int = 0, rejected_token: int = 0) -> PreferencePair:
    """Prompt of 2..6 tokens, responses of different lengths (so token and pair counts vary per pair)."""
    g = torch.Generator().manual_seed(i)
    prompt = [1, *torch.randint(3, VOCAB, (2 + i % 5,), generator=g).tolist()]

    def seq(n: int, token: int) -> Example:
        response = [token] * n if token else torch.randint(3, VOCAB, (n,), generator=g).tolist()
        ids = prompt + response + [2]
        return Example(ids, [IGNORE_INDEX] * len(prompt) + response + [2])

    return PreferencePair(seq(1 + (3 * i) % 7, chosen_token), seq(2 + (5 * i) % 6, rejected_token))


@dataclass(frozen=True)
class Knobs:
    """A pairwise objective's `preference` keys, as these tests set them (the formulas read them back)."""

    objective: str
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.0
    orpo_lambda: float = 0.1
    orpo_prompt_loss: bool = True
    reference: str = "none"


def PreferenceObjective(k: Knobs) -> Objective:
    """The objective a run of `k` trains with, built the way a run builds it: its config through its spec."""
    keys = (
        "beta",
        "loss_type",
        "label_smoothing",
        "simpo_gamma",
        "orpo_lambda",
        "orpo_prompt_loss",
        "reference",
    )
    overrides = [f"train.objective={k.objective}", *(f"preference.{key}={getattr(k, key)}" for key in keys)]
    cfg = load_config(None, overrides)
    return objective_named(k.objective).build_loss(cfg)


def _settings(objective: str, **kw: Any) -> Knobs:
    reference = "precomputed" if objective == "dpo" else "none"
    return Knobs(objective=objective, beta=0.5, reference=reference, **kw)


def _direct_logps(model: torch.nn.Module, example: Example) -> tuple[torch.Tensor, int]:
    """Sum of the response tokens' log-probs, straight from log_softmax (the formula, no zerofit code)."""
    ids = torch.tensor([example.input_ids])
    logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    labels = torch.tensor(example.labels[1:])
    valid = labels != IGNORE_INDEX
    return logp[valid].gather(1, labels[valid].unsqueeze(1)).sum(), int(valid.sum())


# -- per-token log-probs: chunked and fused equal the unchunked reference ---------------------------------


def test_per_token_losses_and_gradients_agree_across_implementations() -> None:
    torch.manual_seed(0)
    rows, seq, hidden = 3, 9, 16
    h = torch.randn(rows, seq, hidden, dtype=torch.float32)
    w = torch.randn(VOCAB, hidden, dtype=torch.float32) * 0.3
    labels = torch.randint(0, VOCAB, (rows, seq))
    labels[:, :3] = IGNORE_INDEX
    labels[1, 6:] = IGNORE_INDEX
    upstream = torch.randn(rows, seq)  # a per-token gradient, as per-row sums times pair losses give

    def run(impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if impl == "fused":
            per = fused_linear_token_sum(hh, ww, None, shifted_targets(labels), chunk=5, per_token=True)
            per = per.reshape(rows, seq)
        else:
            per = token_losses(hh @ ww.t(), labels, impl)
        (per * upstream).sum().backward()
        return per.detach(), hh.grad, ww.grad  # type: ignore[return-value]

    ref = run("unchunked")
    assert ref[0][labels.roll(-1, 1) == IGNORE_INDEX].abs().max() == 0  # nothing where no label follows
    for impl in ("chunked", "fused"):
        got = run(impl)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_chunked_per_token_losses_walk_chunks() -> None:
    """A chunk smaller than the batch gives the same per-token losses (the chunk loop is exercised)."""
    from zerofit.token_loss.sums import _ChunkedCrossEntropySum

    torch.manual_seed(1)
    logits = torch.randn(2, 7, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 7))
    targets = shifted_targets(labels)
    small = _ChunkedCrossEntropySum.apply(logits.reshape(-1, VOCAB), targets, 3, True)
    torch.testing.assert_close(small.reshape(2, 7), token_losses(logits, labels, "unchunked"))


# -- the objectives against their formulas ------------------------------------------------------------------


@pytest.mark.parametrize(
    "objective,kw",
    [
        ("dpo", {}),
        ("dpo", {"loss_type": "hinge"}),
        ("dpo", {"loss_type": "ipo"}),
        ("dpo", {"label_smoothing": 0.2}),
        ("simpo", {"simpo_gamma": 0.4}),
        ("simpo", {"simpo_gamma": 0.0, "label_smoothing": 0.1}),
        ("orpo", {"orpo_lambda": 0.3}),
        ("orpo", {"orpo_lambda": 0.3, "orpo_prompt_loss": False}),
    ],
)
def test_objective_losses_match_the_formulas(objective: str, kw: dict[str, Any]) -> None:
    model = _tiny()
    pairs = [_pair(i) for i in range(3)]
    for k, p in enumerate(pairs):  # a reference that differs from the policy, so margins are not zero
        p.reference = (-30.0 - k, -28.0 + 2 * k)
    s = _settings(objective, **kw)
    batch = collate_pairs(pairs, pad_id=0)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    terms, sums = PreferenceObjective(s).terms(model, inputs, batch, "chunked")

    expected, chosen_nll, chosen_tokens, rewards = [], 0.0, 0, []
    with torch.no_grad():
        for p in pairs:
            (c, nc), (r, nr) = _direct_logps(model, p.chosen), _direct_logps(model, p.rejected)
            c, r = float(c), float(r)
            rc, rr = p.reference  # type: ignore[misc]
            sig = lambda x: -math.log(1 / (1 + math.exp(-x)))  # noqa: E731  -log sigmoid
            if objective == "dpo":
                m = (c - r) - (rc - rr)
                if s.loss_type == "ipo":
                    m = (c / nc - r / nr) - (rc / nc - rr / nr)
                    expected.append((m - 1 / (2 * s.beta)) ** 2)
                elif s.loss_type == "hinge":
                    expected.append(max(0.0, 1 - s.beta * m))
                else:
                    ls = s.label_smoothing
                    expected.append(sig(s.beta * m) * (1 - ls) + sig(-s.beta * m) * ls)
                rewards.append((s.beta * (c - rc), s.beta * (r - rr)))
            elif objective == "simpo":  # gamma is the margin itself (TRL's simpo_gamma), not gamma / beta
                ls, z = s.label_smoothing, s.beta * (c / nc - r / nr) - s.simpo_gamma
                expected.append(sig(z) * (1 - ls) + sig(-z) * ls)
                rewards.append((s.beta * c / nc, s.beta * r / nr))
            else:
                pc, pr = c / nc, r / nr
                odds = (pc - pr) - (math.log(1 - math.exp(pc)) - math.log(1 - math.exp(pr)))
                expected.append(s.orpo_lambda * sig(odds))
                # the NLL: over every chosen token after the first (prompt included), or the response only
                whole = Example(p.chosen.input_ids, p.chosen.input_ids)
                c_nll, n_nll = _direct_logps(model, whole) if s.orpo_prompt_loss else (c, nc)
                chosen_nll, chosen_tokens = chosen_nll - float(c_nll), chosen_tokens + n_nll
                rewards.append((s.orpo_lambda * pc, s.orpo_lambda * pr))
    if objective == "orpo":
        whole = sum(len(p.chosen.input_ids) - 1 for p in pairs)  # position 0 predicts nothing
        response = sum(sum(t != IGNORE_INDEX for t in p.chosen.labels) for p in pairs)
        assert whole > response and chosen_tokens == (whole if s.orpo_prompt_loss else response)
        assert PreferenceObjective(s).counts([batch]) == [chosen_tokens, 3]
        assert float(terms[0].detach()) == pytest.approx(chosen_nll, rel=1e-5)
    assert float(terms[-1].detach()) == pytest.approx(sum(expected), rel=1e-5, abs=1e-6)
    got = dict(zip(METRICS, sums.tolist(), strict=True))
    assert got["rewards/chosen"] == pytest.approx(sum(a for a, _ in rewards), rel=1e-5)
    assert got["rewards/rejected"] == pytest.approx(sum(b for _, b in rewards), rel=1e-5)
    assert got["rewards/accuracies"] == sum(a > b for a, b in rewards)


def _trl_stub(**settings: Any) -> Any:
    """What TRL's loss methods read of their trainer: its settings, and the device."""
    from types import SimpleNamespace

    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), **settings)


def _global_loss(s: Knobs, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """zerofit's loss of one micro-batch that is the whole global batch: sum_k term_k / count_k."""
    obj = PreferenceObjective(s)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        terms, _ = obj.terms(model, inputs, batch, "chunked")
    return sum(float(t) / c for t, c in zip(terms, obj.counts([batch]), strict=True))


@pytest.mark.slow  # importing TRL takes seconds
def test_simpo_and_orpo_equal_trls_losses() -> None:
    """TRL 1.16's own code on the same batch: CPOTrainer.cpo_loss (loss_type simpo, its simpo_gamma the
    margin itself) and ORPOTrainer's NLL (over the chosen prompt and response) plus odds-ratio term equal
    zerofit's loss with the same numbers; ORPO with orpo_prompt_loss=false does not."""
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    model, pairs = _tiny(), [_pair(i) for i in range(4)]
    batch, m = collate_pairs(pairs, pad_id=0), len(pairs)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        means = CPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
        simpo = _trl_stub(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.1)
        trl_simpo = float(CPOTrainer.cpo_loss(simpo, means[:m], means[m:])[0].mean())
        halves = {
            f"{side}_{key}": batch[key][rows]
            for side, rows in (("chosen", slice(0, m)), ("rejected", slice(m, 2 * m)))
            for key in ("input_ids", "attention_mask", "labels")
        }
        orpo = _trl_stub(
            beta=0.3,
            is_encoder_decoder=False,
            padding_value=0,
            aux_loss_enabled=False,
            concatenated_inputs=ORPOTrainer.concatenated_inputs,
            get_batch_logps=ORPOTrainer.get_batch_logps,
        )
        chosen, rejected, _, _, nll = ORPOTrainer.concatenated_forward(orpo, model, halves)
        trl_orpo = float(nll - ORPOTrainer.odds_ratio_loss(orpo, chosen, rejected)[0].mean())
    simpo_s = Knobs("simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.1)
    assert _global_loss(simpo_s, model, batch) == pytest.approx(trl_simpo, abs=1e-6)
    orpo_s = Knobs("orpo", orpo_lambda=0.3)
    assert _global_loss(orpo_s, model, batch) == pytest.approx(trl_orpo, abs=1e-6)
    response_only = Knobs("orpo", orpo_lambda=0.3, orpo_prompt_loss=False)
    assert abs(_global_loss(response_only, model, batch) - trl_orpo) > 1e-2


# -- one global batch, any split: the same loss and gradients -------------------------------------------


def _sgd_strategy(model: torch.nn.Module, precision: str = "fp32") -> Any:
    """A one-process strategy holding `model` with SGD at lr 1 (an update is minus the gradient)."""
    strategy = one_process_strategy(precision)
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=1.0),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    return strategy


def _fp32_config() -> Any:
    """The default config at the tests' seed in fp32: what the reference cache's key is made of."""
    from zerofit.config.schema import ZerofitConfig

    cfg = ZerofitConfig()
    cfg.seed, cfg.train.precision = SEED, "fp32"
    return cfg


def _step(
    model: torch.nn.Module, pairs: list[PreferencePair], micro: int, s: Knobs
) -> tuple[float, dict[str, float], torch.Tensor]:
    """One train_step (SGD lr 1: the update is minus the gradient) on `pairs` in micro-batches of `micro`."""
    model = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    strategy = _sgd_strategy(model)
    batches = [collate_pairs(pairs[k : k + micro], pad_id=0) for k in range(0, len(pairs), micro)]
    result = train_step(strategy, model, batches, None, "chunked", PreferenceObjective(s))
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return result.loss, result.metrics, before - after


@pytest.fixture(scope="module")
def model_and_pairs() -> tuple[torch.nn.Module, list[PreferencePair]]:
    model = _tiny()
    pairs = [_pair(i) for i in range(4)]
    for k, p in enumerate(pairs):
        p.reference = (-31.0 + k, -29.5 - k)
    return model, pairs


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_every_split_gives_the_same_loss_and_gradient(
    model_and_pairs: tuple[torch.nn.Module, list[PreferencePair]], objective: str
) -> None:
    model, pairs = model_and_pairs
    s = _settings(objective)
    (loss, metrics, grad), *others = [_step(model, pairs, micro, s) for micro in (4, 1, 2)]
    assert grad.abs().max() > 1e-4  # the step did something
    for other_loss, other_metrics, other_grad in others:
        assert other_loss == pytest.approx(loss, abs=2e-6)
        assert other_metrics == pytest.approx(metrics, abs=2e-6)
        torch.testing.assert_close(other_grad, grad, rtol=1e-4, atol=1e-6)
    assert set(metrics) == set(METRICS)


def test_a_naive_per_micro_batch_mean_disagrees(
    model_and_pairs: tuple[torch.nn.Module, list[PreferencePair]],
) -> None:
    """Micro-batches of 3 and 1 pairs (a short window, or ORPO's per-micro-batch token means): the mean
    per micro-batch divided by the accumulation steps is not the global batch's mean; ours is."""
    model, pairs = model_and_pairs
    for objective in ("dpo", "orpo"):
        s = _settings(objective)
        obj = PreferenceObjective(s)
        one_loss, _, _ = _step(model, pairs, 4, s)
        ours, _, _ = _step(model, pairs, 3, s)  # [3, 1]
        naive = 0.0
        for part in (pairs[:3], pairs[3:]):
            batch = collate_pairs(part, pad_id=0)
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            with torch.no_grad():
                terms, _ = obj.terms(model, inputs, batch, "chunked")
            naive += sum(float(t) / c for t, c in zip(terms, obj.counts([batch]), strict=True)) / 2
        assert ours == pytest.approx(one_loss, abs=2e-6)
        assert abs(naive - one_loss) > 1e-3, (objective, naive, one_loss)


# -- the reference with the adapters off is the frozen base ---------------------------------------------


def test_adapters_off_reference_equals_the_frozen_base_exactly() -> None:
    from zerofit.models.lora import apply_lora, lora_config

    base = _tiny()
    peft_model = apply_lora(
        _tiny(), lora_config(r=4, alpha=8, dropout=0.0, target_modules="all-linear", use_dora=False)
    )
    with torch.no_grad():  # adapters that change the output (lora_B starts at zero)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    pairs = [_pair(i) for i in range(3)]
    batch = collate_pairs(pairs, pad_id=0)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    labels = batch["labels"]
    peft_model.train()
    with torch.no_grad():
        frozen = row_logps(token_losses(base(**inputs).logits, labels), labels)[0]
        adapted = row_logps(token_losses(peft_model(**inputs).logits, labels), labels)[0]
        with adapters_disabled(peft_model):
            off = row_logps(token_losses(peft_model(**inputs).logits, labels), labels)[0]
    assert (adapted - frozen).abs().max() > 1e-2  # the adapters matter
    assert torch.equal(off, frozen)
    # and through the objective (adapters_off), with the loss inside lm_head as well
    install_fused_head(peft_model.get_base_model())
    install_fused_head(base)
    s = Knobs("dpo", beta=1.0, reference="adapters_off")
    with torch.no_grad():
        _, sums = PreferenceObjective(s).terms(peft_model, inputs, batch, "fused_linear")
    expected = float((adapted[:3] - frozen[:3]).sum())
    assert float(sums[0]) == pytest.approx(expected, rel=1e-4)  # rewards/chosen = sum(pi - ref)


# -- an easy preference task: the reward accuracy rises ---------------------------------------------------


@pytest.mark.slow
def test_tiny_model_learns_an_easy_preference() -> None:
    """Chosen responses repeat token 7, rejected ones token 9: DPO drives the reward accuracy above 0.8."""
    model = _tiny()
    pairs = [_pair(i, chosen_token=7, rejected_token=9) for i in range(16)]
    held_out = [_pair(100 + i, chosen_token=7, rejected_token=9) for i in range(8)]
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    with torch.no_grad():  # the precomputed reference: the model before training
        for p in pairs + held_out:
            p.reference = (
                float(_direct_logps(model, p.chosen)[0]),
                float(_direct_logps(model, p.rejected)[0]),
            )
    obj = PreferenceObjective(_settings("dpo"))
    accuracies = []
    for step in range(12):
        part = pairs[(step % 2) * 8 : (step % 2 + 1) * 8]
        batches = [collate_pairs(part[k : k + 4], pad_id=0) for k in (0, 4)]
        accuracies.append(
            train_step(strategy, model, batches, 1.0, "chunked", obj).metrics["rewards/accuracies"]
        )
    from zerofit.loop.evaluate import preference_evaluation

    evaluated = preference_evaluation(strategy, model, held_out, obj, 4, 0)
    assert accuracies[0] <= 0.5 < accuracies[-1]
    assert evaluated["eval/rewards/accuracies"] > 0.8, (accuracies, evaluated)
    assert evaluated["eval/rewards/margins"] > 0


# -- the precomputed reference: one pass, then the cache --------------------------------------------------


def test_precomputed_reference_is_one_pass_then_the_cache() -> None:
    """The pass scores every pair as the model does one pair at a time; a second run (a resume) reads the
    same table back from a safetensors file without a pass; the key follows the model and the precision."""
    from zerofit.loop.reference import precompute_reference, reference_key

    cfg = _fp32_config()
    model = _tiny()
    strategy = _sgd_strategy(model)
    pairs = [_pair(200 + i) for i in range(5)]  # 5 pairs in micro-batches of 2: the last one is short
    key = reference_key(cfg, pairs)
    assert key is not None
    first = precompute_reference(cfg, strategy, model, pairs, 2, 0)
    try:
        assert not first.cached and first.path is not None and first.path.suffix == ".safetensors"
        with torch.no_grad():
            for p in pairs:
                direct = (
                    float(_direct_logps(model, p.chosen)[0]),
                    float(_direct_logps(model, p.rejected)[0]),
                )
                assert p.reference == pytest.approx(direct, rel=1e-5)
        again = [_pair(200 + i) for i in range(5)]
        second = precompute_reference(cfg, strategy, model, again, 3, 0)
        assert second.cached and "read from the cache, no pass" in second.describe()
        assert [p.reference for p in again] == [p.reference for p in pairs]  # exactly: the same table
        cfg.train.precision = "bf16"
        assert reference_key(cfg, pairs) != key
        cfg.train.precision, cfg.seed = "fp32", SEED + 1  # another tiny-llama: other weights
        assert reference_key(cfg, pairs) != key
    finally:
        first.path.unlink(missing_ok=True)  # type: ignore[union-attr]


def _edited(path: Path, table: torch.Tensor, digest: str | None) -> None:
    """Write `table` to the cache file `path` as loadable safetensors with `digest` (None: no metadata)."""
    from safetensors.torch import save_file

    save_file({"reference_logps": table}, str(path), metadata={"sha256": digest} if digest else None)


def _stale(path: Path) -> None:
    """The values edited, the digest as written: step 1's DPO loss went to 5.007 this way."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        table, digest = f.get_tensor("reference_logps"), f.metadata()["sha256"]
    _edited(path, table - 20.0, digest)


def _non_finite(path: Path) -> None:
    """A NaN, with a digest that matches it."""
    from safetensors.torch import load_file

    from zerofit.loop.reference import _table_digest

    table = load_file(str(path))["reference_logps"]
    table[1, 0] = float("nan")
    _edited(path, table, _table_digest(table))


REFERENCE_TAMPERINGS: dict[str, tuple[Callable[[Path], None], str]] = {
    "values edited, digest stale": (_stale, "does not match the content digest in its metadata"),
    "written without a digest": (
        lambda p: _edited(p, torch.zeros(4, 2, dtype=torch.float64), None),
        "has no content digest in its metadata",
    ),
    "a NaN under a matching digest": (_non_finite, "holds values that are not finite"),
    "another shape": (
        lambda p: _edited(p, torch.zeros(3, 2, dtype=torch.float64), "0" * 64),
        "not the float64 (4, 2) table of these pairs",
    ),
    "not safetensors": (lambda p: p.write_bytes(b"\x08" + b"\0" * 7 + b"garbage"), "could not be read"),
}


def _fresh_pass(
    cfg: Any, strategy: Any, model: torch.nn.Module, pairs: list[PreferencePair], micro: int
) -> Any:
    """`precompute_reference` computing its table in a pass (a file left by an interrupted run of the same
    test is removed first), the cache file's path set."""
    from zerofit.loop.reference import precompute_reference

    first = precompute_reference(cfg, strategy, model, pairs, micro, 0)
    assert first.path is not None
    if first.cached:
        first.path.unlink()
        first = precompute_reference(cfg, strategy, model, pairs, micro, 0)
    return first


@pytest.mark.parametrize("tampering", list(REFERENCE_TAMPERINGS))
def test_a_reference_cache_file_that_fails_a_check_is_computed_again(
    tampering: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache file is checked against its digest, shape and finiteness before use: a bad one is
    never used; the pass runs again (the values a fresh pass gives, so step 1's DPO loss, the policy being
    the reference, is ln 2), the note names the file and the check, and the new file serves the next run."""
    from zerofit.loop.evaluate import preference_evaluation
    from zerofit.loop.reference import precompute_reference

    cfg = _fp32_config()
    model = _tiny()
    strategy = _sgd_strategy(model)
    pairs = [_pair(300 + i) for i in range(4)]  # pairs of their own: a file no other test writes
    first = _fresh_pass(cfg, strategy, model, pairs, 2)
    try:
        fresh = [p.reference for p in pairs]
        tamper, check = REFERENCE_TAMPERINGS[tampering]
        tamper(first.path)
        capsys.readouterr()
        again = [_pair(300 + i) for i in range(4)]
        second = precompute_reference(cfg, strategy, model, again, 2, 0)
        err = capsys.readouterr().err
        assert not second.cached and f"reference log-prob cache file {first.path} " in err and check in err
        assert err.count("\n") == 1
        assert [p.reference for p in again] == fresh
        dpo = PreferenceObjective(_settings("dpo"))
        assert preference_evaluation(strategy, model, again, dpo, 2, 0)["eval/loss"] == pytest.approx(
            math.log(2), abs=1e-6
        )
        third = [_pair(300 + i) for i in range(4)]
        assert precompute_reference(cfg, strategy, model, third, 2, 0).cached  # the file was replaced
        assert [p.reference for p in third] == fresh and capsys.readouterr().err == ""
    finally:
        first.path.unlink(missing_ok=True)


def _shifted(path: Path, nats: float) -> None:
    """Every chosen log-prob moved by `nats`, the digest rewritten to match (zerofit's own `_table_digest`)."""
    from safetensors.torch import load_file

    from zerofit.loop.reference import _table_digest

    table = load_file(str(path))["reference_logps"]
    table[:, 0] += nats
    _edited(path, table, _table_digest(table))


def test_a_bf16_reference_table_is_checked_within_its_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    """A hit is checked against the model on a seeded sample of rows. In bf16 the sample's
    forwards, batched otherwise than the pass, round differently: a genuine table still passes; a half-nat
    shift of the chosen column under a matching digest does not (the tolerance is 2^-8 x (|log-prob| + 1)),
    and the table is computed again."""
    from zerofit.loop.reference import precompute_reference

    cfg = _fp32_config()
    cfg.train.precision = "bf16"
    model = _tiny()
    strategy = _sgd_strategy(model, "bf16")
    fresh = [_pair(400 + i) for i in range(12)]
    first = _fresh_pass(cfg, strategy, model, fresh, 4)
    try:
        capsys.readouterr()
        again = [_pair(400 + i) for i in range(12)]
        assert precompute_reference(cfg, strategy, model, again, 3, 0).cached  # other micro-batches
        assert capsys.readouterr().err == ""
        _shifted(first.path, -0.5)
        shifted = [_pair(400 + i) for i in range(12)]
        assert not precompute_reference(cfg, strategy, model, shifted, 4, 0).cached
        err = capsys.readouterr().err
        assert (
            err.startswith(f"zerofit: {first.path} does not match its source (pair ") and err.count("\n") == 1
        )
        assert "beyond the bf16 tolerance of 0.0039 x (|log-prob| + 1)); rebuilding it" in err
        assert [p.reference for p in shifted] == [p.reference for p in fresh]
    finally:
        first.path.unlink(missing_ok=True)


def test_preference_evaluation_over_0_tokens_is_an_error_never_a_best_loss() -> None:
    """Held-out pairs with a response whose labels are all masked are refused when loaded; ORPO's eval over
    0 chosen tokens, or over no pairs, raises the paragraph instead of returning a 0.0 eval/loss."""
    from zerofit.core.errors import DataError
    from zerofit.loop.evaluate import check_eval_data, preference_evaluation

    def masked(example: Example) -> Example:
        return Example(example.input_ids, [IGNORE_INDEX] * len(example.labels))

    pairs = [_pair(i) for i in range(3)]
    check_eval_data(pairs)
    pairs[1] = PreferencePair(pairs[1].chosen, masked(pairs[1].rejected))
    with pytest.raises(DataError, match="holds 1 of 3 pairs with a response whose labels are all masked"):
        check_eval_data(pairs)
    chosen_masked = [PreferencePair(masked(p.chosen), p.rejected) for p in pairs]
    model, strategy = _tiny(), one_process_strategy()
    # (with its NLL on the responses only: with the prompt's tokens too it has tokens to count, and
    # `check_eval_data` above is what refuses such pairs, when they are loaded)
    orpo = PreferenceObjective(_settings("orpo", orpo_prompt_loss=False))
    with pytest.raises(DataError, match="holds 3 pairs with no response token to score"):
        preference_evaluation(strategy, model, chosen_masked, orpo, 2, 0)
    with pytest.raises(DataError, match="holds no pairs"):
        preference_evaluation(strategy, model, [], orpo, 2, 0)


def test_the_gpu_probe_measures_a_preference_step_on_pairs() -> None:
    """`zerofit plan --probe` feeds 2m rows per micro-batch of m pairs (and the precomputed reference's
    column), so what it measures is a DPO step, not an SFT step of m rows."""
    cfg = load_config(None, ["train.objective=dpo", "preference.reference=precomputed"])
    batch = objective_named("dpo").synthetic_batch(3, 16, VOCAB, 0, cfg)
    assert batch["input_ids"].shape == (6, 16) and int(batch["pairs"]) == 3
    assert batch["reference_logps"].shape == (6,)
    obj = PreferenceObjective(_settings("dpo"))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    terms, sums = obj.terms(_tiny(), inputs, batch, "chunked")
    assert obj.counts([batch]) == [3] and len(terms) == 1 and sums.shape == (len(METRICS),)
    assert objective_named("sft").synthetic_batch(3, 16, VOCAB, 0, cfg)["input_ids"].shape == (
        3,
        16,
    )  # SFT: m rows
