"""What the rest of zerofit asks of a training objective: `ObjectiveSpec`, one per `train.objective`.

An objective is one slice (`zerofit.objectives.<slice>`) and one row of the registry
(`zerofit.objectives.registry`). The resolution, the assembly, the loop, the evaluation, the planner, the probe,
`zerofit plan` and the run's report ask the spec; none of them compares the objective's name or type:

    identity        `name`, `unit` (what the global batch counts and how it is loaded and evaluated)
    config rules    `settle_batch` (before the batch split), `check` (cross-key rules), `fill` (after the
                    plan is chosen), `batch_problem` (a batch split error in the objective's terms)
    abilities       `sequence_parallel`, `vision`, `score_head`, `generates`, `whole_texts`,
                    `rewarded`
    the loss        `build_loss` (the train step's `Objective`, built lazily: torch is imported there)
    the run         `updates_per_rollout`, `advantage_estimator`, `reward_penalty`, `precomputes_reference`,
                    `tokens_per_step`, `describe`
    the planner     `planned_reference`, `no_grad_forwards`, `max_tokens_per_unit`, `planned_line`,
                    `planner_notes`, `teacher_model`
    the probe       `synthetic_batch` (a max-length micro-batch laid out as the loader's own)

This module and every slice's spec import no torch: resolving a config (`zerofit plan`, `import zerofit`) stays
torch-free. The losses live beside each spec (`<slice>/loss.py`) and are imported when a run builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.loss_protocol import Objective

__all__ = ["EXAMPLE", "PAIR", "PROMPT", "UNPAIRED", "ObjectiveSpec", "Unit"]


@dataclass(frozen=True)
class Unit:
    """What one unit of the global batch is: `kind` picks the loader, the collation and the evaluation
    (`example`, `pair`, `unpaired`, `prompt`), `noun` is what the plan counts (`examples`, `pairs`,
    `completions`), `rows` the sequences one unit is in a training forward (a pair's chosen and rejected)."""

    kind: str
    noun: str
    rows: int


EXAMPLE = Unit("example", "examples", 1)  # one supervised example (SFT)
PAIR = Unit("pair", "pairs", 2)  # a preference pair: its chosen and rejected sequences in one forward
UNPAIRED = Unit("unpaired", "examples", 1)  # KTO's example with its label (and its KL row, no-grad)
PROMPT = Unit("prompt", "completions", 1)  # a prompt read, its completions sampled in the run (RL)


class ObjectiveSpec:
    """One training objective as the rest of zerofit sees it (module docstring). The defaults are SFT's
    where an objective adds nothing: no extra rules, no reference, one optimizer update per step."""

    name: str = ""
    unit: Unit = EXAMPLE
    sequence_parallel: bool = False  # its rows may be cut across ranks (distributed.sequence_parallel)
    vision: bool = False  # it trains vision-language models
    score_head: bool = False  # the model's output is a one-output score head (a reward model)
    generates: bool = False  # it samples its training sequences inside the run (rollouts)
    whole_texts: bool = False  # a pair without a prompt is scored as two whole texts (a reward model)
    rewarded: bool = False  # its held-out evaluation is the reward of sampled completions (RL), not a loss

    # ----------------------------------------------------------------------------------- config rules

    def settle_batch(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """Decide what the objective fixes of the batch before it is split (nothing by default)."""

    def batch_problem(self, cfg: ZerofitConfig, error: str) -> str | None:
        """A batch split error said in this objective's terms, or None for the generic wording."""
        return None

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """The objective's cross-key rules: append one paragraph per problem (field, value, rule, fix)."""

    def fill(self, cfg: ZerofitConfig) -> None:
        """Decide what the objective leaves `auto` once every check passed: without a preference reference
        model (every objective but DPO), `preference.reference: auto` is none."""
        if cfg.preference.reference == "auto":
            cfg.preference.reference = "none"

    # -------------------------------------------------------------------------------------- the run

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """The train step's objective for the resolved `cfg` (imports torch)."""
        raise NotImplementedError(f"{type(self).__name__} builds no loss")

    def updates_per_rollout(self, cfg: ZerofitConfig) -> int:
        """Optimizer updates per loop step (more than one only for an objective that reuses its rollout)."""
        return 1

    def advantage_estimator(self, cfg: ZerofitConfig) -> Callable[[Any, int], Any] | None:
        """An objective that generates: each completion's advantage from the global batch's rewards [N]
        (groups contiguous) and the group size, called by the rollout (`zerofit.loop.rollout`); None here."""
        return None

    def reward_penalty(self, cfg: ZerofitConfig) -> Callable[..., Any] | None:
        """An objective that generates: what its rollout subtracts from each reward before the advantages
        (`zerofit.loop.rollout.Rollouts.penalty`: RLOO's KL to the reference), or None."""
        return None

    def precomputes_reference(self, cfg: ZerofitConfig) -> bool:
        """Whether the run computes reference log-probs once before training (`zerofit.loop.reference`)."""
        return False

    def tokens_per_step(self, cfg: ZerofitConfig) -> str | None:
        """The plan's tokens-per-step line when the objective says it itself (None: counted from the data)."""
        return None

    def describe(self, cfg: ZerofitConfig, reference: str) -> str | None:
        """The plan's `objective` line (None: no line, SFT's); `reference` describes a precomputed
        reference (its cache) where the objective has one."""
        return None

    # ---------------------------------------------------------------------------------- the planner

    def no_grad_forwards(self, reference: str) -> int:
        """No-grad forwards of a micro-batch's rows per micro-step besides the policy's, with the planned
        `reference`: one with the adapters off, else none."""
        return int(reference == "adapters_off")

    def planned_reference(self, cfg: ZerofitConfig) -> str:
        """The reference as the planner counts it: `adapters_off` (a no-grad forward per micro-step),
        `precomputed` or `none`."""
        return "none"

    def max_tokens_per_unit(self, cfg: ZerofitConfig) -> tuple[int, str]:
        """The longest training sequence of one unit, and the keys that bound it (for the plan's tokens)."""
        return cfg.data.max_seq_len, "data.max_seq_len"

    def planned_line(self, memory: dict[str, Any]) -> str | None:
        """`zerofit plan`'s line on what the estimate plans for this objective (None: nothing to add)."""
        return None

    def teacher_model(self, cfg: ZerofitConfig) -> str | None:
        """The model the run loads beside the policy, frozen, to learn from (distillation's teacher), or None."""
        return None

    def planner_notes(self, micro_batch_size: int, rows: int, seq_len: int, reference: str) -> list[str]:
        """What the estimate counts for this objective, as notes (none for SFT)."""
        return []

    # ------------------------------------------------------------------------------------ the probe

    def synthetic_batch(
        self, micro: int, seq: int, vocab: int, pad_id: int, cfg: ZerofitConfig
    ) -> dict[str, Any]:
        """A max-length micro-batch of `micro` units, laid out as this objective's loader collates one."""
        from zerofit.objectives.synthetic import token_rows

        return token_rows(micro * self.unit.rows, seq, vocab, pad_id)
