"""GRPO rollouts on the built-in tiny model: split-independent seeded sampling, whole-group advantages, a
failed reward as one agreed paragraph, and a toy verifiable task the tiny model learns (the update's sign)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.config.batching import BatchSplit
from zerofit.core.errors import ZerofitError
from zerofit.data import GlobalBatchSampler
from zerofit.loop.rollout import (
    COMPLETIONS_FILE,
    RewardFailed,
    Rollouts,
    SamplingSettings,
    completion_seed,
    draw_noise,
    sample_completions,
)
from zerofit.loop.train import train_step
from zerofit.models.tiny import build_tokenizer, ensure_tiny_llama
from zerofit.objectives.grpo.loss import GRPOObjective, GRPOSettings
from zerofit.strategies.single import SingleStrategy

DIGITS = set("0123456789")


@dataclass
class Prompt:
    text: str
    input_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    record: int = 0


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(ensure_tiny_llama(), dtype=torch.float32).train()


def _prompts(tokenizer: Any, n: int = 4) -> list[Prompt]:
    texts = ["count: ", "say a number", "n=", "digits please: "][:n]
    return [
        Prompt(t, tokenizer(t, add_special_tokens=False)["input_ids"], {"k": i}, i)
        for i, t in enumerate(texts)
    ]


def digit_share(prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float]:
    """The toy verifiable reward: the share of a completion's characters that are digits (10 of the tiny
    tokenizer's ~100 printable characters, so a random-init model scores ~0.1)."""
    del prompts, columns
    return [sum(ch in DIGITS for ch in c) / max(len(c), 1) for c in completions]


def _scorer(fn: Any) -> Any:
    def score(
        prompts: list[str], completions: list[str], columns: dict[str, list[Any]], step: int, rows: list[int]
    ):
        del step, rows
        values = torch.tensor(fn(prompts, completions, columns), dtype=torch.float64)
        return values, {"digits": values}

    return score


def _rollouts(tokenizer: Any, micro: int, accum: int, score: Any, group: int = 4, new: int = 6) -> Rollouts:
    prompts = _prompts(tokenizer)
    return Rollouts(
        prompts=prompts,
        sampler=GlobalBatchSampler(len(prompts), 2, seed=0),
        batch=BatchSplit(2 * group, micro, accum, 1),
        group_size=group,
        sampling=SamplingSettings(new, (tokenizer.eos_token_id,), tokenizer.pad_token_id),
        score=score,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        seed=7,
        reward_names=("digits",),
        log_completions_every=1,
    )


def _strategy(model: torch.nn.Module, lr: float = 0.0) -> SingleStrategy:
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.Adam(m.parameters(), lr=lr),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    return strategy


def test_a_completion_is_the_same_whatever_its_batch(tokenizer: Any) -> None:
    """Each completion has its own generator seeded from (seed, step, index): sampled alone, in pairs or all
    together (different left padding, different neighbours), the tokens are the same."""
    model = _model()
    prompts = [p.input_ids for p in _prompts(tokenizer)]
    s = SamplingSettings(
        8, (tokenizer.eos_token_id,), tokenizer.pad_token_id, temperature=1.0, top_k=50, top_p=0.9
    )
    seeds = [completion_seed(3, 5, i) for i in range(4)]
    together = sample_completions(model, prompts, seeds, s, torch.device("cpu"))
    alone = [
        sample_completions(model, [p], [k], s, torch.device("cpu"))[0]
        for p, k in zip(prompts, seeds, strict=True)
    ]
    assert [c.ids for c in together] == [c.ids for c in alone]
    assert len({tuple(c.ids) for c in together}) > 1  # not one degenerate answer
    assert model.training  # the mode is restored


def _reference(model: torch.nn.Module, prompt: list[int], seed: int, s: SamplingSettings) -> list[int]:
    """One completion the slow, obvious way: no KV cache, no batch, one `torch.multinomial` per token from
    the completion's own generator over softmax(top-k / top-p filtered logits / T) (the sampler before it
    was batched)."""
    from zerofit.loop.rollout import _filtered

    gen, ids = torch.Generator().manual_seed(seed), list(prompt)
    with torch.no_grad():
        for _ in range(s.max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[:, -1].float() / s.temperature
            probs = torch.softmax(_filtered(logits, s.top_k, s.top_p), dim=-1)
            ids.append(int(torch.multinomial(probs[0], 1, generator=gen)))
            if ids[-1] in s.eos_ids:
                break
    return ids[len(prompt) :]


@pytest.mark.parametrize("filters", [{}, {"top_k": 20, "top_p": 0.9, "temperature": 0.7}])
def test_each_completion_is_its_own_whatever_finishes_beside_it(
    tokenizer: Any, filters: dict[str, Any]
) -> None:
    """A batch of 8 (4 prompts x 2, so each prompt's KV cache is shared) in which rows finish early and leave
    the batch: every completion is the tokens it has sampled alone, and the tokens a plain per-token
    `torch.multinomial` with the completion's own generator samples (so a seed samples what it did when
    each token was one multinomial call)."""
    model = _model().eval()
    prompts = [p.input_ids for p in _prompts(tokenizer) for _ in range(2)]
    s = SamplingSettings(24, (tokenizer.eos_token_id,), tokenizer.pad_token_id, **filters)
    seeds = [completion_seed(11, 2, i) for i in range(8)]
    together = sample_completions(model, prompts, seeds, s, torch.device("cpu"))
    early = [c for c in together if not c.truncated and len(c.ids) < s.max_new_tokens]
    assert early and any(c.truncated for c in together), [len(c.ids) for c in together]  # rows left early
    for i in (0, 3, 5):
        alone = sample_completions(model, [prompts[i]], [seeds[i]], s, torch.device("cpu"))[0]
        assert alone.ids == together[i].ids and alone.truncated == together[i].truncated
    assert [c.ids for c in together] == [
        _reference(model, p, k, s) for p, k in zip(prompts, seeds, strict=True)
    ]


def test_a_completion_draws_its_noise_in_one_call(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each completion's randomness is one `exponential_` call on its own generator (all its tokens' noise),
    not one multinomial per token."""
    calls: list[int] = []
    exponential = torch.Tensor.exponential_

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(id(kwargs.get("generator")))
        return exponential(self, *args, **kwargs)

    def refused(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("torch.multinomial called")

    monkeypatch.setattr(torch.Tensor, "exponential_", counted)
    monkeypatch.setattr(torch, "multinomial", refused)
    prompts = [p.input_ids for p in _prompts(tokenizer) for _ in range(2)]
    s = SamplingSettings(16, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    sampled = sample_completions(
        _model(), prompts, [completion_seed(1, 0, i) for i in range(8)], s, torch.device("cpu")
    )
    assert len(calls) == 8 and len(set(calls)) == 8  # one call per completion, each on its own generator
    assert max(len(c.ids) for c in sampled) > 1


def test_the_noise_is_multinomials_own_draw() -> None:
    """argmax(probs / noise) over a generator's one-call noise picks, token by token, what successive
    `torch.multinomial(probs, 1, generator=...)` calls with the same seed pick."""
    probs = torch.softmax(torch.randn(12, 300, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    gen = torch.Generator().manual_seed(42)
    expected = [int(torch.multinomial(row, 1, generator=gen)) for row in probs]
    noise = draw_noise([torch.Generator().manual_seed(42)], 12, 300, torch.device("cpu"))[0]
    assert (probs / noise).argmax(dim=-1).tolist() == expected


def test_the_step_batches_and_metrics_do_not_depend_on_the_split(tokenizer: Any, tmp_path: Path) -> None:
    model = _model()
    strategy = _strategy(model)
    whole = _rollouts(tokenizer, 8, 1, _scorer(digit_share))
    split = _rollouts(tokenizer, 2, 4, _scorer(digit_share))
    b1, m1 = whole.step_batches(strategy, model, 0)
    b2, m2 = split.step_batches(strategy, model, 0)
    adv1 = b1[0]["advantages"]
    adv2 = torch.cat([b["advantages"] for b in b2])
    assert torch.equal(adv1, adv2)
    assert torch.allclose(adv1.view(2, 4).sum(dim=1), torch.zeros(2), atol=1e-5)  # centred per whole group
    timing = ("time/", "generation_tokens_per_s")
    assert {k: v for k, v in m1.items() if not k.startswith(timing)} == {
        k: v for k, v in m2.items() if not k.startswith(timing)
    }
    assert 0 <= m1["completions/truncated_fraction"] <= 1 and m1["completions/max_length"] <= 6
    whole.log_completions(tmp_path, 1)
    rows = [json.loads(line) for line in (tmp_path / COMPLETIONS_FILE).read_text().splitlines()]
    assert len(rows) == 4 and {"step", "prompt", "completion", "reward"} <= set(rows[0])


def test_a_failed_reward_stops_with_its_paragraph(tokenizer: Any) -> None:
    def broken(*args: Any) -> Any:
        raise ZerofitError("reward digits failed at step 1, row 3: ValueError: no")

    model = _model()
    with pytest.raises(RewardFailed, match="reward digits failed at step 1, row 3") as err:
        _rollouts(tokenizer, 8, 1, broken).step_batches(_strategy(model), model, 0)
    assert err.value.agreed


@pytest.mark.slow
def test_the_tiny_model_learns_the_toy_task(tokenizer: Any) -> None:
    """Reward = the share of digits in the completion: the random-init tiny model starts near 0.1 and, with
    full-weight Adam at lr 3e-3, G = 8, 2 prompts a step, exceeds 0.8 mean reward within 40 CPU steps. An
    update of the wrong sign drives the share of digits to 0; no update leaves it at ~0.1."""
    model = _model()
    strategy = _strategy(model, lr=3e-3)
    rollouts = _rollouts(tokenizer, 16, 1, _scorer(digit_share), group=8)
    objective = GRPOObjective(GRPOSettings(loss_type="dapo", max_completion_length=6))
    curve = []
    for step in range(40):
        batches, metrics = rollouts.step_batches(strategy, model, step)
        curve.append(metrics["reward"])
        if step >= 3 and min(curve[-3:]) > 0.8:
            break
        train_step(strategy, model, batches, 1.0, "unchunked", objective)
    assert sum(curve[:2]) / 2 < 0.2, curve
    assert min(curve[-3:]) > 0.8, curve


# --- the held-out reward (`zerofit.loop.held_out`) --------------------------------------------------------


def test_the_held_out_reward_is_seeded_split_free_and_greedy_on_request(tokenizer: Any) -> None:
    """The held-out prompts' reward: the same seeds at every evaluation (two calls agree), the same answers
    whatever the prompts sampled at once, each reward function's mean beside the weighted total; greedy is
    the argmax continuation (checked against a plain argmax loop) and does not vary with the seed."""
    from zerofit.loop.held_out import held_out_rewards

    model = _model()
    strategy = _strategy(model)
    rollouts = _rollouts(tokenizer, 2, 1, _scorer(digit_share), new=5)
    prompts = _prompts(tokenizer)
    one = held_out_rewards(strategy, rollouts, prompts, per_rank=1, steps_done=3)
    again = held_out_rewards(strategy, rollouts, prompts, per_rank=4, steps_done=3)
    assert one == again
    assert one["eval/prompts"] == 4 and one["eval/rewards/digits"] == one["eval/reward"]
    assert 0 < one["eval/completions/mean_length"] <= 5
    greedy = held_out_rewards(strategy, rollouts, prompts, per_rank=3, steps_done=3, sampling="greedy")
    reseeded = dataclasses.replace(rollouts, seed=99)
    assert (
        held_out_rewards(strategy, reseeded, prompts, per_rank=3, steps_done=3, sampling="greedy") == greedy
    )
    assert held_out_rewards(strategy, reseeded, prompts, per_rank=3, steps_done=3) != one
    expected = [_argmax_answer(model, p.input_ids, 5, tokenizer.eos_token_id) for p in prompts]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert greedy["eval/reward"] == pytest.approx(sum(digit_share([], texts, {})) / 4)
    assert greedy["eval/completions/mean_length"] == pytest.approx(sum(map(len, expected)) / 4)
    assert model.training  # the mode is restored


def _argmax_answer(model: torch.nn.Module, prompt: list[int], new: int, eos: int) -> list[int]:
    """A greedy completion the slow, obvious way: the whole sequence's forward per token, its argmax."""
    ids: list[int] = []
    with torch.no_grad():
        model.eval()
        for _ in range(new):
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
            if ids[-1] == eos:
                break
        model.train()
    return ids


def test_each_rank_samples_its_share_of_every_window() -> None:
    """5 held-out prompts, 2 a rank at once, 2 ranks: windows [0..3] and [4]; rank 1's share of the last
    is empty (it samples a dummy row, dropped, so both ranks run the same sampling calls)."""
    from zerofit.loop.held_out import _my_windows

    assert _my_windows(5, 2, 2, 0) == [[0, 1], [4]]
    assert _my_windows(5, 2, 2, 1) == [[2, 3], []]
    assert _my_windows(3, 4, 1, 0) == [[0, 1, 2]]


def test_a_failed_reward_at_an_evaluation_stops_with_its_paragraph(tokenizer: Any) -> None:
    from zerofit.loop.held_out import held_out_rewards

    def broken(*args: Any) -> Any:
        raise ZerofitError("reward digits failed at step 2, row 1: ValueError: no")

    model = _model()
    rollouts = _rollouts(tokenizer, 2, 1, broken)
    with pytest.raises(RewardFailed, match="reward digits failed at step 2"):
        held_out_rewards(_strategy(model), rollouts, _prompts(tokenizer), per_rank=2, steps_done=2)
