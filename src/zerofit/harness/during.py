"""`eval.harness`: lm-eval on the weights of a training step, by rank 0, on every engine.

When due (every `eval.harness.every_steps` optimizer steps, and after the last one), every rank takes part
in the gather the final export uses (`Strategy.full_state_dict`: ZeRO-3's partitions and FSDP2's shards
consolidated, rank 0 gets the whole state dict on the CPU); rank 0 loads it into its own evaluation copy of
the model (built once, on first use: the base as the run loaded it plus the run's adapters, so the training
model, its engine and its optimizer are not touched) and runs lm-eval on it in eval mode without gradients
(`harness.evaluate`). The other ranks wait for it through the store (`wait_for_rank0`: lm-eval may outlast
the process-group timeout), then every rank receives rank 0's scores, so each decides the same about the best
checkpoint and early stopping (`eval.harness.best_metric`). The scores join the step's row of metrics.jsonl
(and W&B's history with it) as `harness/<task>/<metric>`; lm-eval's whole results go to
`eval/harness-step-N.json`. The copy costs rank 0 a second set of the model's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerofit.core.errors import DataError, ZerofitError
from zerofit.harness.evaluate import HarnessSettings, LoadedTasks, evaluate, load_tasks, replies, scores
from zerofit.harness.results import score_fields, write_results
from zerofit.loop.evaluate import evaluation_due
from zerofit.strategies.base import Strategy

__all__ = ["HarnessDuringTraining"]


@dataclass
class HarnessDuringTraining:
    """The loop's `Evaluating` for `eval.harness` (see the module docstring). `build_copy` makes rank 0's
    evaluation model and its tokenizer (called once, on rank 0 only)."""

    strategy: Strategy
    settings: HarnessSettings
    every_steps: int
    max_steps: int
    run_dir: Path
    build_copy: Callable[[], tuple[Any, Any]]
    _tasks: LoadedTasks | None = field(default=None, init=False)
    _copy: tuple[Any, Any] | None = field(default=None, init=False)

    def prepare(self) -> None:
        """Resolve the tasks on rank 0 before training (a hub task's data fetched, or refused in one
        paragraph); every rank raises the same refusal, so none waits for a rank that stopped."""
        problem = None
        if self.strategy.rank == 0:
            try:
                self._tasks = load_tasks(self.settings.tasks)
            except ZerofitError as exc:
                problem = str(exc)
        problem = self.strategy.broadcast_object(problem)
        if problem is not None:
            raise DataError(f"eval.harness: {problem}")

    def due(self, steps_done: int) -> bool:
        """Whether the harness runs after `steps_done` steps: every `every_steps`, and after the last."""
        return evaluation_due(steps_done, self.every_steps, self.max_steps)

    def after_step(self, steps_done: int) -> dict[str, Any]:
        """The step's `harness/*` fields when due (the same dict on every rank), else {}. Collective."""
        if not self.due(steps_done):
            return {}
        state = self.strategy.full_state_dict()  # every rank takes part; rank 0 holds the result
        fields = self._evaluate(steps_done, state) if self.strategy.rank == 0 else None
        self.strategy.wait_for_rank0("rank 0 to run lm-eval (eval.harness)")
        return dict(self.strategy.broadcast_object(fields) or {})

    def _evaluate(self, steps_done: int, state: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0: load `state` into the evaluation copy, score it, write the results file."""
        assert state is not None and self._tasks is not None, "prepare() first, on rank 0"
        if self._copy is None:
            self._copy = self.build_copy()
        model, tokenizer = self._copy
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(f"eval.harness: gathered tensors fit no weight: {result.unexpected_keys[:3]}")
        results = evaluate(model, tokenizer, self._tasks, self.settings)
        found = scores(results)
        report = {
            "step": steps_done,
            "weights": f"the training step's weights (gathered from every rank, step {steps_done})",
            "settings": {k: getattr(self.settings, k) for k in self.settings.__dataclass_fields__},
            "scores": {"trained": found},
            "replies": {"trained": replies(results)},
        }
        write_results(self.run_dir, steps_done, report)
        return score_fields(found)
