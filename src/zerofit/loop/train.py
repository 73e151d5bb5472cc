"""One global batch per optimizer step, token-exact whatever the split (docs/design.md, "Gradient accumulation").

    train_step: what the objective decides over the whole window first (`Objective.before_window`: KTO's
                KL reference point z0, one all-reduce; nothing for the others) -> count the window's
                normalizers on this rank (the objective's `counts`: valid label tokens for SFT, pairs for
                DPO / SimPO, chosen tokens and pairs for ORPO and CPO; `zerofit.objectives.protocol`) ->
                all-reduce once (before any backward) -> per micro-step: forward, the objective's *sums*
                / their global counts (x the engine's gradient divide factor), backward (sync only on
                the last) -> clip once, step once -> loss (and the objective's `metric_means`).
    train_loop: for each optimizer step: this rank's micro-batches of global batch `step` (a fixed number
                of examples each, or packed rows under a token budget) -> train_step -> evaluation when
                due (`zerofit.loop.evaluate`) -> metrics (docs/contracts.md, metrics.jsonl) -> one tiny
                all-reduce agrees on what happens next (a stop signal on any rank, rank 0's clock saying
                a timed save is due, rank 0's verdict on the evaluation: a new best, patience run out;
                rank 0's metrics write failing on a full disk, a NaN / inf loss, gradient norm or weights
                on any rank: every rank stops with one paragraph, before any save)
                -> periodic, timed, best or final checkpoint -> stop (signal or early stopping).

Nothing here depends on the split: the global batch is a fixed slice of the data order (the sampler), the
normalizer is the whole global batch's token (or pair) count, and the engine only contributes its divide
factor. A preference global batch is a fixed set of pairs; a pair's chosen and rejected rows are always in
the same micro-batch (`zerofit.data.pairs.pair_micro_batches`), packed or not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from zerofit.checkpoint.failed_save import attempt, metrics_failed
from zerofit.checkpoint.manifest import checkpoint_folders
from zerofit.checkpoint.policy import EvalWatch, SaveClock, Verdict
from zerofit.config.batching import BatchSplit
from zerofit.core.errors import MetricsWriteError, TrainingDiverged
from zerofit.core.progress import Progress, progress
from zerofit.core.run_layout import RunLayout
from zerofit.data import (
    Example,
    GlobalBatchSampler,
    collate,
    collate_packed,
    model_inputs,
    packed_micro_batches,
    split_global_batch,
)
from zerofit.data.pairs import PreferencePair, pair_micro_batches
from zerofit.data.unpaired import UnpairedExample, kto_micro_batches
from zerofit.levers.compiling import graph_breaks
from zerofit.levers.sequence_parallel import shard_micro_batch
from zerofit.loop.rollout import COMPLETIONS_TABLE, RewardFailed, Rollouts
from zerofit.loop.signals import StopSignal
from zerofit.metrics.base import MetricsSink, TableSink
from zerofit.metrics.memory import memory_snapshot, per_rank_fields
from zerofit.metrics.throughput import throughput_fields
from zerofit.objectives.protocol import Objective
from zerofit.objectives.sft.loss import SFTObjective
from zerofit.strategies.base import Strategy
from zerofit.token_loss.sums import batch_labels, count_label_tokens


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did: global token-mean loss, pre-clip grad norm, global valid label tokens,
    global input tokens (prompts included, padding not: the useful tokens the model computed on, for MFU)
    and global processed tokens (every position of every micro-batch, padding included); a preference
    objective's per-pair means (`rewards/*`, `logps/*`; empty for SFT)."""

    loss: float
    grad_norm: float
    tokens: int
    input_tokens: int
    processed_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def train_step(
    strategy: Strategy,
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    max_grad_norm: float | None,
    cross_entropy: str = "chunked",
    objective: Objective | None = None,
) -> StepResult:
    """One global batch: this rank's `micro_batches` (as many as every other rank's), one optimizer step.

    `cross_entropy` is `train.cross_entropy` (the same token sums, see `zerofit.token_loss.sums`; `fused_linear`
    computes them inside lm_head, `zerofit.token_loss.fused`). `objective` is train.objective's
    (`ObjectiveSpec.build_loss`; None: SFT's token sums).
    """
    objective = objective if objective is not None else SFTObjective()
    objective.before_window(strategy, model, micro_batches, cross_entropy)  # KTO's z0, over the global batch
    # 1. The normalizers: the objective's counts (SFT: valid label tokens) of the whole global batch, over
    #    all ranks, before any backward (valid, useful and processed input tokens ride along in the same
    #    all-reduce, for throughput accounting).
    counts, tokens = window_counts(objective, micro_batches)
    local = [
        *counts,
        tokens,
        sum(int(b["attention_mask"].sum()) for b in micro_batches),
        sum(b["input_ids"].numel() for b in micro_batches),
    ]
    *counts, tokens, input_tokens, processed_tokens = summed_over_ranks(strategy, local)
    # 2. The one place that scales the loss: each sum by its global count, and back up by what the engine
    #    divides reduced gradients by (dp for averaging engines), so the reduced gradient is exactly the
    #    gradient of (sum of token or pair losses) / count. max(., 1): an all-masked window adds zero.
    scales = [strategy.grad_divide_factor / max(count, 1) for count in counts]
    # Accumulated on the device: a `.cpu()` per micro-step would force a GPU sync inside the window.
    local_sums = torch.zeros(
        len(counts) + len(objective.metrics), dtype=torch.float64, device=strategy.device
    )
    for j, batch in enumerate(micro_batches):
        with strategy.accumulate(is_last=j == len(micro_batches) - 1):
            inputs = model_inputs(batch, strategy.device)
            terms, metric_sums = objective.terms(model, inputs, batch, cross_entropy)
            strategy.backward(_scaled(terms, scales))
        _accumulate(local_sums, terms, metric_sums)
    # 3. After the window: global pre-clip norm, clip once, one optimizer and one scheduler step.
    grad_norm = strategy.clip_and_step(max_grad_norm)
    sums = strategy.all_reduce_sum(local_sums).tolist()
    loss = sum(total / max(count, 1) for total, count in zip(sums[: len(counts)], counts, strict=True))
    # The metrics: means over the objective's units, its last count (KTO's: per label, and z0).
    metrics = objective.metric_means(sums[len(counts) :], counts[-1])
    return StepResult(loss, grad_norm, tokens, input_tokens, processed_tokens, metrics)


def window_counts(
    objective: Objective, micro_batches: list[dict[str, torch.Tensor]]
) -> tuple[list[int], int]:
    """The objective's normalizers of this rank's window and its valid label tokens. SFT's one count is
    those tokens (`SFTObjective.counts`): counted once for both, not twice (each count is a comparison, a
    sum and a read per micro-batch)."""
    if type(objective) is SFTObjective:
        counts = objective.counts(micro_batches)
        return counts, counts[0]
    return objective.counts(micro_batches), sum(count_label_tokens(*batch_labels(b)) for b in micro_batches)


def summed_over_ranks(strategy: Strategy, values: list[int]) -> list[int]:
    """Each of `values` summed over every rank (`Strategy.all_reduce_sum`, one collective for all); in one
    process the values themselves, with no tensor built and copied for an identity (the loop asks twice a
    step: the window's counts and the agreement after it)."""
    if strategy.world_size == 1:
        return list(values)
    return strategy.all_reduce_sum(torch.tensor(values, dtype=torch.int64)).tolist()


def _accumulate(local_sums: torch.Tensor, terms: list[torch.Tensor], metric_sums: torch.Tensor) -> None:
    """Add a micro-batch's terms and metric sums to the window's fp64 sums, on the device. One term and no
    metrics (SFT): one add, the fp32 term promoted to fp64 inside it (exactly, as the general path's cast
    does), instead of a cast, a stack and a concatenation per micro-step."""
    if len(terms) == 1 and not metric_sums.numel():
        local_sums += terms[0].detach()
        return
    local_sums += torch.cat([torch.stack([t.detach().double() for t in terms]), metric_sums])


def _scaled(terms: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    """The micro-batch's share of the global loss: each sum times its scale (one term for SFT and DPO)."""
    out = terms[0] * scales[0]
    for term, scale in zip(terms[1:], scales[1:], strict=True):
        out = out + term * scale
    return out


class CheckpointSaver(Protocol):
    """What the loop needs from `zerofit.checkpoint.Checkpointer`: called after every step; the second
    argument forces a save (a decision every rank agreed on), the third is the valid label tokens trained on
    since step 0 (a checkpoint records it, so a resume continues the count)."""

    def after_step(self, steps_done: int, force: bool = False, tokens_seen: int | None = None, /) -> None: ...


class Evaluating(Protocol):
    """What the loop needs from `zerofit.loop.evaluate.Evaluator`: the `eval/*` metrics when an evaluation is due
    after `steps_done` optimizer steps, else {} (every rank calls it at every step)."""

    def after_step(self, steps_done: int) -> dict[str, Any]: ...


@dataclass
class LoopInputs:
    """Everything the loop touches, built by `zerofit.recipe.assembly.PreparedRun.loop_inputs`."""

    strategy: Strategy
    model: torch.nn.Module
    examples: list[Example] | list[PreferencePair] | list[UnpairedExample]
    sampler: GlobalBatchSampler
    batch: BatchSplit
    max_steps: int
    max_grad_norm: float | None
    pad_id: int
    sink: MetricsSink
    checkpointer: CheckpointSaver
    log_every: int = 1
    flops_per_token: float | None = None  # model FLOPs per trained token, for MFU (None: not reported)
    precision: str = "bf16"
    cross_entropy: str = "chunked"
    packed_row_tokens: int | None = None  # token budget: rows of this many tokens (data.max_seq_len)
    evaluator: Evaluating | None = None  # None: no evaluation data
    harness: Evaluating | None = (
        None  # eval.harness: lm-eval's `harness/*` scores when due (every rank alike)
    )
    stop: StopSignal | None = None  # SIGTERM/SIGINT: stop after the step in progress, on every rank
    clock: SaveClock | None = None  # checkpoint.every_minutes (rank 0's clock decides)
    watch: EvalWatch | None = None  # best evaluation (checkpoint.keep_best) and train.early_stopping
    keep_best: bool = False  # a new best evaluation forces a save of that step
    objective: Objective | None = None  # train.objective's (`zerofit.objectives.pairwise.loss`); None: SFT
    compiled: bool = False  # train.compile: each row reports dynamo's graph breaks so far
    run_dir: Path | None = None  # where rank 0's metrics go: named by a failed metrics write
    rollouts: Rollouts | None = (
        None  # train.objective grpo: each step's micro-batches are sampled (loop.rollout)
    )
    updates_per_rollout: int = 1  # rl.num_iterations: optimizer steps on each rollout


@dataclass(frozen=True)
class AfterStep:
    """What every rank agreed after a step: stop for a signal, save because rank 0's clock says so, the
    evaluation's verdict (rank 0's), and so whether to save and whether the loop ends."""

    stopping: bool = False
    timed: bool = False
    verdict: Verdict | None = None
    metrics_failed: bool = False  # rank 0 could not write this step's metrics: the run stops, no save
    diverged: bool = False  # a non-finite loss, gradient norm or weights on some rank: the run stops, no save

    @property
    def early_stop(self) -> bool:
        """The evaluation ended the early-stopping patience."""
        return self.verdict is not None and self.verdict.exhausted

    def save(self, keep_best: bool) -> bool:
        """Whether this step's checkpoint is written now (besides the periodic and final ones)."""
        best = keep_best and self.verdict is not None and self.verdict.best
        return self.stopping or self.timed or self.early_stop or best


def rank_micro_batches(run: LoopInputs, step: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """This rank's collated micro-batches of global batch `step`, and the global batch's sample count.

    Without a token budget: `grad_accum_steps` micro-batches of `micro_batch_size` examples. With one
    (`packed_row_tokens`): packed rows, `micro_batch_size` rows per micro-batch, as many micro-batches as
    the rank that needs the most (SFT's at most `grad_accum_steps`; pairs and KTO's examples: `zerofit.data.pairs`,
    `zerofit.data.unpaired`).
    """
    indices = run.sampler.batch_indices(step)
    # The data-parallel rank: every rank of a sequence-parallel group gets its group's examples.
    p, rank = run.batch, run.strategy.dp_rank
    args = (p.micro_batch_size, p.grad_accum_steps, p.dp_size, rank, run.pad_id, run.packed_row_tokens)
    if run.examples and isinstance(run.examples[0], UnpairedExample):  # KTO: each with its mismatched partner
        units: Any = run.examples
        return kto_micro_batches(units, indices, *args), len(indices)
    if run.examples and isinstance(run.examples[0], PreferencePair):  # a pair is never split
        pairs: list[Any] = run.examples
        return pair_micro_batches(pairs, indices, *args), len(indices)
    examples: list[Any] = run.examples
    if run.packed_row_tokens is None:
        mine = split_global_batch(indices, p.micro_batch_size, p.grad_accum_steps, p.dp_size, rank)
        batches = [collate([examples[i] for i in idx], run.pad_id) for idx in mine]
        return [_sequence_shard(run, b) for b in batches], len(indices)
    lengths = {i: len(examples[i].input_ids) for i in indices}
    packed = packed_micro_batches(
        indices, lengths, p.micro_batch_size, run.packed_row_tokens, p.dp_size, rank
    )
    micro_batches = [
        collate_packed([[examples[i] for i in row] for row in rows], run.pad_id) for rows in packed
    ]
    return micro_batches, len(indices)


def _sequence_shard(run: LoopInputs, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shard of its group's micro-batch under sequence parallelism (the batch itself without)."""
    s = run.strategy
    if s.sp_size == 1:
        return batch
    return shard_micro_batch(batch, s.sp_size, s.sp_rank, run.batch.micro_batch_size, run.pad_id)


def step_metrics(
    run: LoopInputs,
    step: int,
    result: StepResult,
    lr: float,
    seconds: float,
    samples: int,
    tokens_seen: int,
) -> dict[str, Any]:
    """The per-step fields of `metrics.jsonl` (docs/contracts.md), memory aside."""
    return {
        "loss": result.loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "tokens": result.tokens,
        "tokens_seen": tokens_seen,
        **result.metrics,
        **throughput_fields(
            step_time_s=seconds,
            tokens=result.tokens,
            samples=samples,
            useful_tokens=result.input_tokens,
            processed_tokens=result.processed_tokens,
            flops_per_token=run.flops_per_token,
            device=run.strategy.device,
            world_size=run.strategy.world_size,  # every device, sequence-parallel ones too
            precision=run.precision,
        ),
        "micro_batch_size": run.batch.micro_batch_size,
        "grad_accum_steps": run.batch.grad_accum_steps,
        "dp_size": run.batch.dp_size,
        "epoch": run.sampler.epoch_of(step),
        "partial_window": run.sampler.is_partial(step),
        "step_skipped": not run.strategy.step_applied,
        # train.compile: the graph breaks dynamo met compiling the layers (at the first step, and at each new
        # shape it recompiles for), a running total of this process (`zerofit.levers.compiling`).
        **({"compile/graph_breaks": graph_breaks()} if run.compiled else {}),
    }


def memory_fields(strategy: Strategy) -> dict[str, Any]:
    """Every rank's memory, gathered with one collective (so call it on every rank at the same step)."""
    return per_rank_fields(strategy.all_gather_object(memory_snapshot(strategy.device)))


def train_loop(run: LoopInputs, start_step: int = 0, tokens_before: int = 0) -> list[StepResult]:
    """Optimizer steps `start_step`..`max_steps - 1`; metrics are logged with `step` = steps done (1-based).

    `tokens_before`: the valid label tokens of steps 0..`start_step - 1` (a resumed run's, from its
    checkpoint); every row's `tokens_seen` counts on from it, every step's tokens included, logged or not
    (`logging.log_every`), so no consumer has to add up the rows' `tokens`.
    """
    with progress("training", run.max_steps, "steps", enabled=run.strategy.rank == 0) as shown:
        return _train_steps(run, start_step, tokens_before, shown)


def _train_steps(run: LoopInputs, start_step: int, tokens_before: int, shown: Progress) -> list[StepResult]:
    """The steps of `train_loop`; `shown` counts them (a step longer than the progress interval, or an
    evaluation, gets a line saying where the run is)."""
    results: list[StepResult] = []
    seen = tokens_before
    trainable: list[torch.nn.Parameter] | None = None  # found after the first step (an engine's lazy set-up)
    for step in range(start_step, run.max_steps):
        shown.update(step)
        started = time.perf_counter()
        lr = run.strategy.current_lr()  # the LR this step's update uses
        result, samples = _train_on_step(run, step)
        seconds = time.perf_counter() - started
        results.append(result)
        seen += result.tokens  # global (all-reduced): the same on every rank and for every split
        steps_done = step + 1
        # NaN / inf (the same on every rank: global values): no evaluation of such weights, its row logged.
        trainable = trainable if trainable is not None else trainable_parameters(run.model)
        bad = non_finite(result, run.strategy.step_applied, trainable)
        evaluated = {
            **(run.evaluator.after_step(steps_done) if run.evaluator is not None and bad is None else {}),
            **(run.harness.after_step(steps_done) if run.harness is not None and bad is None else {}),
        }
        logged = bool(evaluated) or steps_done % run.log_every == 0 or steps_done == run.max_steps
        logged = logged or bad is not None
        row = functools.partial(step_metrics, run, step, result, lr, seconds, samples, seen)
        failure = _log_row(run, steps_done, {**row(), **evaluated}) if logged else None
        followed = evaluated.get(run.watch.metric) if run.watch is not None else None
        agreed = agree_after_step(run, followed, logged, failure is not None, bad is not None)
        if agreed.metrics_failed:
            raise _metrics_write_error(run, steps_done, failure)
        if agreed.diverged:  # before any save: the last checkpoint stays the last good one
            raise diverged(run, steps_done, bad or "a value on another rank is not finite", lr)
        if agreed.stopping and not logged:
            # A signal stops the run between logging steps: its last step gets a row too, so the rows end
            # at the steps done (the summary's count) and at the stop checkpoint a resume starts from.
            failure = _log_row(run, steps_done, row())
            if run.strategy.broadcast_object(failure) is not None:
                raise _metrics_write_error(run, steps_done, failure)
        if run.watch is not None and agreed.verdict is not None:
            run.watch.record(steps_done, float(evaluated[run.watch.metric]), agreed.verdict)
        run.checkpointer.after_step(steps_done, agreed.save(run.keep_best), seen)
        if agreed.stopping or agreed.early_stop:
            break
    return results


def _train_on_step(run: LoopInputs, step: int) -> tuple[StepResult, int]:
    """One loop step's update(s) and its sample count: SFT and preference objectives train on the data's
    global batch `step`; GRPO samples it first (`zerofit.loop.rollout`: its metrics join the step's) and
    takes `updates_per_rollout` optimizer steps on it (the row reports the last update's loss and norm)."""
    if run.rollouts is None:
        micro_batches, samples = rank_micro_batches(run, step)
        return train_step(
            run.strategy, run.model, micro_batches, run.max_grad_norm, run.cross_entropy, run.objective
        ), samples
    try:
        micro_batches, rl_metrics = run.rollouts.step_batches(run.strategy, run.model, step)
    except RewardFailed as exc:  # before the step trains or saves: say what the run kept
        raise RewardFailed(f"{exc} {_kept(run, step + 1)}") from None
    started = time.perf_counter()
    for _ in range(run.updates_per_rollout):
        result = train_step(
            run.strategy, run.model, micro_batches, run.max_grad_norm, run.cross_entropy, run.objective
        )
    rl_metrics["time/training_s"] = time.perf_counter() - started
    if run.run_dir is not None and run.strategy.rank == 0:
        shown = run.rollouts.log_completions(run.run_dir, step + 1)
        if shown and isinstance(run.sink, TableSink):  # W&B: a table of the same rows
            run.sink.log_table(step + 1, COMPLETIONS_TABLE, shown)
    samples = run.batch.micro_batch_size * run.batch.grad_accum_steps * run.batch.dp_size
    return dataclasses.replace(result, metrics={**result.metrics, **rl_metrics}), samples


def non_finite(
    result: StepResult, step_applied: bool, trainable: list[torch.nn.Parameter] | None = None
) -> str | None:
    """What of this step is NaN or inf, or None when all is finite: the loss, the gradient norm of an
    applied step, or (an update that overflowed) this rank's `trainable` weights after it
    (`trainable_parameters`).

    A gradient norm that is not finite on a step the fp16 loss scaler skipped (`step_applied` False: the
    scaler lowers its scale and the weights are untouched, by design) is not a divergence; a loss that is
    not finite always is (weights that produce one never recover, skipped steps or not).
    """
    if not math.isfinite(result.loss):
        return f"the loss is {result.loss}"
    if step_applied and not math.isfinite(result.grad_norm):
        return f"the gradient norm is {result.grad_norm}"
    if step_applied and trainable is not None and not weights_finite(trainable):
        return "the weights the update wrote are not all finite (the loss and gradient norm were)"
    return None


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters `model` trains, in order: found once per `train_loop`, after its first step (so an
    engine's set-up at the first forward, FSDP2's lazy init, is done), not at every step: walking a peft
    model's modules costs more than checking the weights themselves."""
    return [p for p in model.parameters() if p.requires_grad]


def weights_finite(trainable: list[torch.nn.Parameter]) -> bool:
    """Whether this rank's `trainable` weights (its own shard under FSDP2 / ZeRO-3) are all finite: one
    device sync for all of them, so a checkpoint is never written from an update that overflowed.

    It runs after every step, so it costs a handful of ops whatever the number of tensors. On CPU and CUDA
    it is the loss scaler's own non-finite check (`_amp_foreach_non_finite_check_and_unscale_`, what
    `GradScaler.unscale_` runs on gradients): one foreach op that sets a flag at any NaN, +inf or -inf,
    element by element (no norm that a finite value could overflow), several times cheaper than a norm per
    tensor. With an unscale factor of exactly 1 it writes every value back as it read it (the kernels skip
    the multiply then): the weights' bytes do not change. Elsewhere, `_finite_by_norms`."""
    shards = (p.to_local() if isinstance(p, DTensor) else p for p in trainable)
    local = [t for t in shards if t.numel()]
    if not local:
        return True
    device = local[0].device
    if device.type not in _FLAGGED_DEVICES or any(t.device != device for t in local):
        return _finite_by_norms(local)
    with torch.no_grad():  # an in-place op on leaves that require grad (their values unchanged)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        unscale = torch.ones(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(local, found, unscale)
        return not bool(found)


# Devices whose loss-scaler check `weights_finite` runs (a CPU and a CUDA kernel in every torch it supports).
_FLAGGED_DEVICES = frozenset({"cpu", "cuda"})


def _finite_by_norms(local: list[torch.Tensor]) -> bool:
    """`weights_finite` on other devices (or tensors spread over several): each tensor's fp32 2-norm in one
    foreach call (a NaN or inf anywhere makes its tensor's norm NaN or inf: sums of squares propagate both),
    one stack, one test. Finite weights whose norm overflows fp32 (|w| beyond ~1e19) fail that test too, so
    a failed test is confirmed element by element before it counts."""
    with torch.no_grad():  # no graph, and no detach per tensor
        norms = torch._foreach_norm(local, 2.0, dtype=torch.float32)
        return bool(torch.stack(norms).isfinite().all()) or bool(
            torch.stack([torch.isfinite(t).all() for t in local]).all()
        )


def _kept(run: LoopInputs, steps_done: int, resume: str = "") -> str:
    """What a run that stops at step `steps_done` before saving it kept, and how to go on once its cause is
    fixed: the newest complete checkpoint and the resume command (`resume`: what the command adds), or
    that no checkpoint was saved yet."""
    folders = checkpoint_folders(RunLayout(run.run_dir).checkpoints) if run.run_dir is not None else []
    if not folders:
        return (
            f"No checkpoint was saved yet (nothing of step {steps_done} was): once fixed, start the run again"
        )
    step, folder = folders[-1]
    return (
        f"The last good checkpoint, {folder} (step {step}), is kept: nothing of step {steps_done} was saved. "
        f"Once fixed, resume from it with the same command plus checkpoint.resume=true{resume}"
    )


def diverged(run: LoopInputs, steps_done: int, what: str, lr: float) -> TrainingDiverged:
    """The one paragraph for a step whose loss, gradient norm or weights are not finite (every rank)."""
    kept = _kept(
        run,
        steps_done,
        " and checkpoint.allow_changes=[KEY] for the key you changed (e.g. optimizer.lr), or start a new run "
        "(checkpoint.resume=false)",
    )
    return TrainingDiverged(
        f"training diverged at step {steps_done}: {what}, so the run stops here (an update from it would "
        "make every later step NaN). Likely causes: a learning rate too high for this model (this step's "
        f"lr {lr:g}; optimizer.lr), a preference.beta too large (DPO / SimPO / ORPO), or an fp16 overflow "
        f"(train.precision=fp16: bf16 has fp32's range). {kept}"
    )


def _log_row(run: LoopInputs, steps_done: int, fields: dict[str, Any]) -> str | None:
    """Log one metrics row (every rank: the memory fields are a collective); rank 0's failed write (a full
    disk) as one line, else None."""
    fields = {**fields, **memory_fields(run.strategy)}
    return attempt(functools.partial(run.sink.log, steps_done, fields))


def _metrics_write_error(run: LoopInputs, steps_done: int, failure: str | None) -> MetricsWriteError:
    """Rank 0's paragraph for its failed metrics write (its file, its filesystem's free space), on every rank."""
    text = None
    if run.strategy.rank == 0:
        assert failure is not None and run.run_dir is not None, "rank 0 logs, into the run directory"
        text = str(metrics_failed(run.run_dir, steps_done, failure))
    return MetricsWriteError(run.strategy.broadcast_object(text))


def agree_after_step(
    run: LoopInputs,
    eval_loss: float | None,
    logged: bool = False,
    write_failed: bool = False,
    bad: bool = False,
) -> AfterStep:
    """One tiny all-reduce after every step (none when there is nothing to agree on), so every rank saves
    and stops after the same step: each rank's stop-signal votes, and rank 0's alone for a due timed save,
    the evaluation's verdict and a failed metrics write (other ranks add zeros, so no other clock or
    rounding can differ).

    `eval_loss` is this step's evaluation the watch follows (eval/loss; an RL objective's eval/reward), or
    None when no evaluation ran; `logged`: rank 0 wrote this
    step's metrics (the same on every rank); `write_failed`: that write failed here (a full disk); `bad`:
    this step is not finite here (`non_finite`; any rank's vote stops every rank).
    """
    stop, rank0 = run.stop, run.strategy.rank == 0
    judged = run.watch is not None and eval_loss is not None
    if stop is None and run.clock is None and not judged and not logged and not bad:
        return AfterStep()
    signals = stop.votes() if stop is not None else []
    mine = Verdict(False, False)
    if judged and rank0:
        assert run.watch is not None and eval_loss is not None
        mine = run.watch.judge(eval_loss)
    timed = run.clock is not None and rank0 and run.clock.due()
    local = [*signals, int(timed), int(mine.best), int(mine.exhausted), int(write_failed and rank0), int(bad)]
    votes = summed_over_ranks(run.strategy, local)
    n = len(signals)
    stopping = stop is not None and stop.agree(votes[:n])
    verdict = Verdict(bool(votes[n + 1]), bool(votes[n + 2])) if judged else None
    return AfterStep(stopping, bool(votes[n]), verdict, bool(votes[n + 3]), bool(votes[n + 4]))
