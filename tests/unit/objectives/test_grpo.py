"""The GRPO objective: each loss type equals its paper's definition by hand, the split changes nothing, and a
per-micro-batch normalization would."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.loop.rollout import micro_batch
from zerofit.loop.train import train_step
from zerofit.objectives.grpo.loss import GRPOObjective, GRPOSettings, group_advantages
from zerofit.strategies.single import SingleStrategy

VOCAB = 11
G = 4


class TinyLM(torch.nn.Module):
    """Embedding + position embedding + linear head: per-token log-probs that depend on every input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.pos = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Any = None,
        position_ids: Any = None,
        use_cache: bool = False,
    ) -> Any:
        del attention_mask, use_cache
        hidden = self.embed(input_ids) + self.pos(position_ids)

        class Out:
            logits = self.head(hidden)

        return Out()


# Two groups of G = 4: prompts of 2 and 3 tokens, completions of 1..7 tokens (the token means differ a lot).
PROMPTS = [[1, 2], [3, 4, 5]]
COMPLETIONS = [[(i * 3 + j) % (VOCAB - 1) + 1 for j in range(1 + (i * 5) % 7)] for i in range(2 * G)]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.0], dtype=torch.float64)


def _batches(micro: int, advantages: torch.Tensor, trained: list[bool] | None = None) -> list[dict[str, Any]]:
    trained = trained or [True] * len(COMPLETIONS)
    out = []
    for k in range(0, len(COMPLETIONS), micro):
        idx = list(range(k, k + micro))
        out.append(
            micro_batch(
                [PROMPTS[i // G] for i in idx],
                [COMPLETIONS[i] for i in idx],
                [trained[i] for i in idx],
                advantages[idx],
                pad_id=0,
            )
        )
    return out


def _hand_token_logps(model: TinyLM) -> list[list[float]]:
    """Each completion's token log-probs, one sequence at a time, no padding (the definition)."""
    out = []
    with torch.no_grad():
        for i, completion in enumerate(COMPLETIONS):
            ids = torch.tensor([PROMPTS[i // G] + completion])
            logits = model(ids, position_ids=torch.arange(ids.size(1)).unsqueeze(0)).logits[0]
            logp = torch.log_softmax(logits.double(), dim=-1)
            p = len(PROMPTS[i // G])
            out.append([float(logp[p + j - 1, tok]) for j, tok in enumerate(completion)])
    return out


def test_group_advantages_are_trls() -> None:
    a = group_advantages(REWARDS, G, "group")
    first = REWARDS[:G]
    expected = (first - first.mean()) / (first.std(unbiased=True) + 1e-4)
    assert torch.allclose(a[:G], expected)
    assert torch.allclose(group_advantages(REWARDS, G, "none")[G:], REWARDS[G:] - REWARDS[G:].mean())
    batch = group_advantages(REWARDS, G, "batch")
    assert torch.allclose(batch[:G], (first - first.mean()) / (REWARDS.std() + 1e-4))


def _hand_loss(loss_type: str, advantages: torch.Tensor, beta_kl: list[list[float]] | None = None) -> float:
    """The papers' definitions at ratio 1 (on-policy: the clipped surrogate is -A per token), plus beta k3.

    GRPO (Shao et al. 2024, eq. 3): 1/G sum_i 1/|o_i| sum_t; DAPO (Yu et al. 2025, eq. 8): 1/sum|o_i| sum_i
    sum_t; Dr. GRPO (Liu et al. 2025): sum_i sum_t / (N x L), L the generation budget."""
    per_token = [
        [-float(advantages[i]) + (beta_kl[i][t] if beta_kl else 0.0) for t in range(len(c))]
        for i, c in enumerate(COMPLETIONS)
    ]
    n = len(per_token)
    if loss_type == "grpo":
        return sum(sum(row) / len(row) for row in per_token) / n
    if loss_type == "dapo":
        return sum(sum(row) for row in per_token) / sum(len(row) for row in per_token)
    return sum(sum(row) for row in per_token) / (n * 16)


def _strategy(model: torch.nn.Module) -> SingleStrategy:
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    return strategy


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_each_loss_type_is_its_papers_definition(loss_type: str) -> None:
    advantages = group_advantages(REWARDS, G, "group")
    model = TinyLM()
    objective = GRPOObjective(GRPOSettings(loss_type=loss_type, max_completion_length=16))
    result = train_step(_strategy(model), model, _batches(8, advantages), None, "unchunked", objective)
    assert result.loss == pytest.approx(_hand_loss(loss_type, advantages), abs=1e-6)
    assert result.metrics["clip_ratio"] == 0.0 and result.metrics["kl"] == 0.0


def test_the_gradient_is_the_policy_gradient_of_the_definition() -> None:
    """At ratio 1 the grpo loss's gradient is -1/G sum_i A_i/|o_i| sum_t grad log pi(o_i,t): checked against
    autograd of that expression computed one unpadded sequence at a time."""
    advantages = group_advantages(REWARDS, G, "group")
    model, hand = TinyLM(), TinyLM()
    train_step(
        _strategy(model),
        model,
        _batches(4, advantages),
        None,
        "unchunked",
        GRPOObjective(GRPOSettings(loss_type="grpo")),
    )
    total = torch.zeros((), dtype=torch.float64)
    for i, completion in enumerate(COMPLETIONS):
        ids = torch.tensor([PROMPTS[i // G] + completion])
        logp = torch.log_softmax(hand(ids, position_ids=torch.arange(ids.size(1)).unsqueeze(0)).logits[0], -1)
        p = len(PROMPTS[i // G])
        lp = torch.stack([logp[p + j - 1, t] for j, t in enumerate(completion)])
        total = total - float(advantages[i]) * lp.sum().double() / len(completion)
    (total / len(COMPLETIONS)).backward()
    with torch.no_grad():
        for p_hand in hand.parameters():
            p_hand -= 0.5 * p_hand.grad
    for a, b in zip(model.parameters(), hand.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_beta_adds_k3_to_the_reference() -> None:
    """With beta > 0 the reference is the model with adapters off: here a peft LoRA model whose adapters were
    trained away from the base, so k3 > 0 and the loss is the definition's plus beta x k3 per token."""
    peft = pytest.importorskip("peft")
    base = TinyLM()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["head"], init_lora_weights=False))
    policy = [[lp for lp in row] for row in _hand_token_logps(model)]
    with model.disable_adapter():
        ref = _hand_token_logps(model)
    k3 = [
        [math.exp(r - p) - (r - p) - 1 for r, p in zip(rr, pp, strict=True)]
        for rr, pp in zip(ref, policy, strict=True)
    ]
    advantages = group_advantages(REWARDS, G, "group")
    beta = 0.3
    objective = GRPOObjective(GRPOSettings(loss_type="dapo", beta=beta))
    result = train_step(_strategy(model), model, _batches(2, advantages), None, "unchunked", objective)
    expected = _hand_loss("dapo", advantages, [[beta * x for x in row] for row in k3])
    assert result.loss == pytest.approx(expected, abs=1e-5)
    tokens = sum(len(c) for c in COMPLETIONS)
    assert result.metrics["kl"] == pytest.approx(sum(map(sum, k3)) / tokens, rel=1e-4)


def test_clipping_uses_epsilon_and_epsilon_high() -> None:
    from zerofit.objectives.grpo.loss import token_loss

    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros_like(logps)
    s = GRPOSettings(epsilon=0.2, epsilon_high=0.28)
    mask = torch.ones_like(logps, dtype=torch.bool)
    pos, _, clipped_pos = token_loss(logps, old, torch.tensor([1.0]), None, s, mask)
    assert pos.tolist()[0] == pytest.approx([-1.28, -0.5, -1.1])
    neg, _, clipped_neg = token_loss(logps, old, torch.tensor([-1.0]), None, s, mask)
    assert neg.tolist()[0] == pytest.approx([1.5, 0.8, 1.1])
    assert clipped_pos.tolist() == [[True, False, False]] and clipped_neg.tolist() == [[False, True, False]]


def _curve(loss_type: str, micro: int, steps: int = 4) -> list[tuple[float, float]]:
    model = TinyLM()
    strategy = _strategy(model)
    objective = GRPOObjective(GRPOSettings(loss_type=loss_type, max_completion_length=16))
    advantages = group_advantages(REWARDS, G, "group")
    out = []
    for _ in range(steps):
        result = train_step(strategy, model, _batches(micro, advantages), None, "unchunked", objective)
        out.append((result.loss, result.grad_norm))
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_eight_by_one_equals_two_by_four(loss_type: str) -> None:
    """One process, 8 completions in one micro-batch vs 4 micro-batches of 2: the same loss and grad norm
    for 4 steps (fp32, within 2e-5)."""
    whole, split = _curve(loss_type, 8), _curve(loss_type, 2)
    for (l1, g1), (l2, g2) in zip(whole, split, strict=True):
        assert l1 == pytest.approx(l2, abs=2e-5) and g1 == pytest.approx(g2, abs=2e-5)


def test_a_per_micro_batch_token_mean_disagrees() -> None:
    """The dapo loss normalized per micro-batch (each micro-batch's own token mean, averaged over the
    accumulation steps, what a naive implementation does) is not the global token mean."""
    advantages = group_advantages(REWARDS, G, "group")
    exact = _hand_loss("dapo", advantages)
    per_micro = []
    for k in range(0, len(COMPLETIONS), 2):
        rows = range(k, k + 2)
        per_micro.append(
            sum(-float(advantages[i]) * len(COMPLETIONS[i]) for i in rows)
            / sum(len(COMPLETIONS[i]) for i in rows)
        )
    naive = sum(per_micro) / len(per_micro)
    assert abs(naive - exact) > 1e-2
    assert _curve("dapo", 2, steps=1)[0][0] == pytest.approx(exact, abs=1e-6)


def test_masked_truncated_completions_still_count_as_completions() -> None:
    advantages = group_advantages(REWARDS, G, "group")
    trained = [len(c) < 7 for c in COMPLETIONS]
    model = TinyLM()
    objective = GRPOObjective(GRPOSettings(loss_type="grpo"))
    result = train_step(
        _strategy(model), model, _batches(4, advantages, trained), None, "unchunked", objective
    )
    expected = sum(-float(advantages[i]) for i in range(len(COMPLETIONS)) if trained[i]) / len(COMPLETIONS)
    assert result.loss == pytest.approx(expected, abs=1e-6)
    assert result.tokens == sum(len(c) for c, t in zip(COMPLETIONS, trained, strict=True) if t)
