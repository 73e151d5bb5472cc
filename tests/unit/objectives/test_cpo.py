"""CPO (`train.objective: cpo`) in one process: its loss equals TRL's CPOTrainer on the same model and pairs
(fp32, within 1e-6: TRL takes the NLL as CrossEntropyLoss's mean over the chosen response tokens, zerofit as
their sum over the global batch's count of them, the same number at one micro-batch), its terms are the
formula's, and one global batch gives one loss and one gradient however it is split."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from zerofit.config import load_config
from zerofit.data import IGNORE_INDEX, Example
from zerofit.data.pairs import PreferencePair, collate_pairs
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.objectives.protocol import Objective
from zerofit.objectives.registry import objective_named

SEED, VOCAB = 3, 128


def _tiny() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(SEED), dtype=torch.float32)


def _pair(i: int) -> PreferencePair:
    """Prompts of 2..6 tokens, responses of different lengths (token and pair counts vary per pair)."""
    g = torch.Generator().manual_seed(i)
    prompt = [1, *torch.randint(3, VOCAB, (2 + i % 5,), generator=g).tolist()]

    def seq(n: int) -> Example:
        response = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        return Example(prompt + response + [2], [IGNORE_INDEX] * len(prompt) + response + [2])

    return PreferencePair(seq(1 + (3 * i) % 7), seq(2 + (5 * i) % 6))


def _cpo(*overrides: str) -> Objective:
    """CPO's objective as a run builds it: its config through its spec."""
    cfg = load_config(None, ["train.objective=cpo", "preference.reference=none", *overrides])
    return objective_named("cpo").build_loss(cfg)


def _global_loss(obj: Objective, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """zerofit's loss of one micro-batch that is the whole global batch: sum_k term_k / count_k."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        terms, _ = obj.terms(model, inputs, batch, "chunked")
    return sum(float(t) / c for t, c in zip(terms, obj.counts([batch]), strict=True))


def _trl_cpo(model: torch.nn.Module, batch: dict[str, torch.Tensor], **settings: Any) -> float:
    """TRL 1.16's own CPOTrainer code on the batch: concatenated_forward (log-probs, the chosen NLL) and
    cpo_loss, combined as its get_batch_loss_metrics does: losses.mean() + cpo_alpha x NLL."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    m = int(batch["pairs"])
    halves = {
        f"{side}_{key}": batch[key][rows]
        for side, rows in (("chosen", slice(0, m)), ("rejected", slice(m, 2 * m)))
        for key in ("input_ids", "attention_mask", "labels")
    }
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu")),
        is_encoder_decoder=False,
        pad_token_id=0,
        aux_loss_enabled=False,
        concatenated_inputs=CPOTrainer.concatenated_inputs,
        get_batch_logps=CPOTrainer.get_batch_logps,
        alpha=0.0,
        **settings,
    )
    with torch.no_grad():
        chosen, rejected, _, _, nll = CPOTrainer.concatenated_forward(trainer, model, halves)
        losses = CPOTrainer.cpo_loss(trainer, chosen, rejected)[0]
    return float(losses.mean() + trainer.cpo_alpha * nll)


@pytest.mark.slow  # importing TRL takes seconds
@pytest.mark.parametrize(
    "settings",
    [
        {"loss_type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "cpo_alpha": 1.0},
        {"loss_type": "sigmoid", "beta": 0.3, "label_smoothing": 0.1, "cpo_alpha": 0.5},
        {"loss_type": "hinge", "beta": 0.2, "label_smoothing": 0.0, "cpo_alpha": 1.0},
        {"loss_type": "ipo", "beta": 0.4, "label_smoothing": 0.0, "cpo_alpha": 0.0},
    ],
)
def test_the_loss_equals_trls_cpo_trainer(settings: dict[str, Any]) -> None:
    pytest.importorskip("trl")
    model, pairs = _tiny(), [_pair(i) for i in range(4)]
    batch = collate_pairs(pairs, pad_id=0)
    ours = _cpo(*(f"preference.{k}={v}" for k, v in settings.items()))
    assert _global_loss(ours, model, batch) == pytest.approx(_trl_cpo(model, batch, **settings), abs=1e-6)


def test_its_terms_are_the_formulas() -> None:
    """The NLL term is the chosen response tokens' summed NLL over their count; the pair term DPO's sigmoid
    of beta x the summed log-prob margin; rewards beta x the summed log-probs."""
    model, pairs = _tiny(), [_pair(i) for i in range(3)]
    batch = collate_pairs(pairs, pad_id=0)
    obj = _cpo("preference.beta=0.3", "preference.cpo_alpha=0.7")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        terms, sums = obj.terms(model, inputs, batch, "unchunked")
        logps = []
        for seq in [p.chosen for p in pairs] + [p.rejected for p in pairs]:
            ids = torch.tensor([seq.input_ids])
            logp = model(input_ids=ids).logits.log_softmax(-1)[0, :-1]
            labels = torch.tensor(seq.labels[1:])
            picked = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
            logps.append((float(picked[labels != IGNORE_INDEX].sum()), int((labels != IGNORE_INDEX).sum())))
    chosen, rejected = logps[:3], logps[3:]
    nll = -sum(c for c, _ in chosen)
    pair = sum(
        -math.log(1 / (1 + math.exp(-0.3 * (c - r)))) for (c, _), (r, _) in zip(chosen, rejected, strict=True)
    )
    assert obj.counts([batch]) == [sum(n for _, n in chosen), 3]
    assert float(terms[0]) == pytest.approx(0.7 * nll, rel=1e-5)
    assert float(terms[1]) == pytest.approx(pair, rel=1e-5)
    assert float(sums[0]) == pytest.approx(0.3 * sum(c for c, _ in chosen), rel=1e-5)
    assert float(sums[2]) == sum(c > r for (c, _), (r, _) in zip(chosen, rejected, strict=True))
