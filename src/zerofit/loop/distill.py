"""On-policy distillation's rollouts (`train.objective: gkd`): each completion of the step is, with probability
`gkd.lmbda`, the student's own sample, else the data's completion (or, with `gkd.seq_kd`, the teacher's sample).

The step's global batch is GRPO's (`zerofit.loop.rollout`, whose engine this reuses): the sampler's prompts,
rl.num_generations completions each, global completion c answering prompt c // G, split micro x accumulation
x data-parallel as any global batch. Whether completion c is on-policy is a coin drawn from (seed, step, c)
alone (`on_policy`), and a sampled completion's tokens come from its own generator seeded from the same triple
(`completion_seed`), so every completion, and so the loss, is the same whatever the split, and a resumed
run draws what the uninterrupted one did. The teacher samples (seq_kd) with the same seeds, no gradients.

TRL's GKDTrainer draws one coin per micro-batch (`random.random() <= lmbda`), so which completions are
on-policy depends on the split; here the same expected fraction is drawn per completion. Nothing is scored:
the step's metrics are the on-policy fraction and the completions' lengths.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from zerofit.core.progress import progress
from zerofit.loop.rollout import (
    PromptRow,
    Rollouts,
    Sampled,
    completion_seed,
    generating,
    micro_batch,
    sample_completions,
)
from zerofit.strategies.base import Strategy

__all__ = ["ON_POLICY", "DistillRollouts", "no_rewards", "on_policy"]

ON_POLICY = "on_policy_fraction"  # metrics.jsonl: the step's share of the student's own samples


def on_policy(seed: int, step: int, index: int, lmbda: float) -> bool:
    """Whether global completion `index` of step `step` is the student's sample: a uniform draw in [0, 1)
    from 53 bits of a hash of the triple (its own salt: independent of the sampling seed), below lmbda."""
    digest = hashlib.sha256(f"zerofit-gkd/{seed}/{step}/{index}".encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 11) / float(1 << 53) < lmbda


def no_rewards(
    prompts: list[str], completions: list[str], columns: object, step: int, records: list[int]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation scores nothing (its signal is the teacher): every completion's reward is 0."""
    return torch.zeros(len(completions)), {}


@dataclass
class DistillRollouts(Rollouts):
    """GKD's rollouts (module docstring): `completions` holds each data record's completion ids (None where a
    record has none; only lmbda 1 or seq_kd runs read none), `teacher` the frozen teacher (seq_kd samples)."""

    completions: list[list[int] | None] | None = None
    teacher: torch.nn.Module | None = None
    lmbda: float = 0.5
    seq_kd: bool = False

    def step_batches(
        self, strategy: Strategy, model: torch.nn.Module, step: int
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """This rank's micro-batches of step `step`, and the step's metrics (global)."""
        started = time.perf_counter()
        rows, total, mine = self.step_split(strategy, step)
        flat = [c for micro in mine for c in micro]
        prompt_of = {c: self.prompts[rows[c // self.group_size]] for c in flat}
        student = [c for c in flat if on_policy(self.seed, step, c, self.lmbda)]
        teacher = [c for c in flat if c not in set(student)] if self.seq_kd else []
        chosen = self._sampled(strategy, step, student, prompt_of, None)
        chosen.update(self._sampled(strategy, step, teacher, prompt_of, self.teacher))
        for c in flat:
            if c not in chosen:
                chosen[c] = self._data_completion(prompt_of[c])
        generation_s = time.perf_counter() - started
        zeros = torch.zeros(total)
        batches = [
            micro_batch(
                [prompt_of[c].input_ids for c in micro],
                [chosen[c].ids for c in micro],
                [True] * len(micro),
                zeros[micro],
                self.sampling.pad_id,
            )
            for micro in mine
        ]
        self._show(strategy, prompt_of, chosen, set(student))
        return batches, self._step_metrics(strategy, total, chosen, set(student), generation_s)

    def _sampled(
        self,
        strategy: Strategy,
        step: int,
        which: list[int],
        prompt_of: dict[int, PromptRow],
        sampler: torch.nn.Module | None,
    ) -> dict[int, Sampled]:
        """Completions `which` sampled by the student (`sampler` None: the engine's bare module) or the
        teacher, each from its own seed; none when `which` is empty (no collective: each rank samples alone)."""
        if not which:
            self._gather_once(strategy, prompt_of, sampler)
            return {}
        seeds = [completion_seed(self.seed, step, c) for c in which]
        prompts = [prompt_of[c].input_ids for c in which]
        who = "the student" if sampler is None else "the teacher"
        what = f"step {step + 1}: {who} samples {len(which)} completions"
        with (
            generating(strategy) as policy,
            progress(what, self.sampling.max_new_tokens, "tokens", enabled=strategy.rank == 0) as shown,
        ):
            model = policy if sampler is None else sampler
            sampled = sample_completions(model, prompts, seeds, self.sampling, strategy.device, shown)
        return dict(zip(which, sampled, strict=True))

    def _gather_once(
        self, strategy: Strategy, prompt_of: dict[int, PromptRow], sampler: torch.nn.Module | None
    ) -> None:
        """A rank that samples nothing from the student still runs one forward of a prompt under `generating`:
        under FSDP2 the first forward all-gathers every layer, a collective every rank must join."""
        if sampler is not None or not prompt_of:
            return
        ids = torch.tensor([next(iter(prompt_of.values())).input_ids[:1]], device=strategy.device)
        with generating(strategy) as policy, torch.no_grad():
            policy(input_ids=ids, use_cache=False)

    def _data_completion(self, prompt: PromptRow) -> Sampled:
        """The data's completion of `prompt`'s record (checked present when the data was loaded)."""
        assert self.completions is not None, "an off-policy completion needs the data's completions"
        ids = self.completions[prompt.record]
        assert ids is not None, f"record {prompt.record} has no completion"
        return Sampled(ids, False, 0.0)

    def _show(
        self,
        strategy: Strategy,
        prompt_of: dict[int, PromptRow],
        chosen: dict[int, Sampled],
        student: set[int],
    ) -> None:
        """Rank 0 keeps its completions for `log_completions` (prompt, completion, whether on-policy)."""
        if strategy.rank == 0:
            self.shown = [
                {"prompt": p.text, "completion": self.decode(chosen[c].ids), "on_policy": c in student}
                for c, p in prompt_of.items()
            ]

    def _step_metrics(
        self,
        strategy: Strategy,
        total: int,
        chosen: dict[int, Sampled],
        student: set[int],
        generation_s: float,
    ) -> dict[str, float]:
        """The step's fields of metrics.jsonl over the global batch: the on-policy fraction and the
        completions' lengths (one all-reduce of a [3, N] table, each rank's columns its own)."""
        local = torch.zeros(3, total, dtype=torch.float64)
        for c, s in chosen.items():
            local[:, c] = torch.tensor([float(c in student), float(len(s.ids)), float(s.truncated)])
        table = strategy.all_reduce_sum(local.to(strategy.device)).cpu()
        return {
            ON_POLICY: float(table[0].mean()),
            "completions/mean_length": float(table[1].mean()),
            "completions/min_length": float(table[1].min()),
            "completions/max_length": float(table[1].max()),
            "completions/truncated_fraction": float(table[2].mean()),
            "time/generation_s": generation_s,
        }
