"""One assembly for every real run: resolved config -> engine spec -> strategy -> run directory -> data ->
the run plan -> model -> optimizer and scheduler -> a prepared run.

The launcher, the GPU probe (`zerofit plan --probe`) and both benchmarks build their runs here and only
here, so what the probe and the benchmarks measure is exactly what a run does: the same spec, the same
seed before the model, quantized weights placed on the rank's GPU at load time, the same answer to "who
builds the optimizer".

The order is the user's: the tokenizer and the data come before the model, so a bad data file fails in
seconds rather than after a 7B load; the run directory (and the checkpoint a resume starts from) is
settled before either, once, on rank 0, for every rank. Once the data is loaded, the run plan is made
(`zerofit.engine_spec.run_plan.make_run_plan`, once): the model, the optimizer, the loop and every record of the run are
built from it, and nothing replaces it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerofit.checkpoint.resume import settle_run_dir
from zerofit.checkpoint.shared_storage import check_shared_output_dir
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import DataError, LaunchError, ZerofitError
from zerofit.data import (
    DataStats,
    Example,
    GlobalBatchSampler,
    PreferencePair,
    TokenizedData,
    eval_source,
    hold_out,
    load_examples,
    load_preference_pairs,
    set_chat_template,
)
from zerofit.data.prompts import PromptExample
from zerofit.data.truncation import check_truncation
from zerofit.data.unpaired import UnpairedExample
from zerofit.engine_spec import render_spec
from zerofit.engine_spec.run_plan import DataFacts, RunPlan, make_run_plan
from zerofit.loop.evaluate import Evaluator, check_eval_data
from zerofit.loop.train import CheckpointSaver, LoopInputs
from zerofit.metrics.throughput import train_flops_per_token
from zerofit.models.build import BuiltModel, build_model, load_tokenizer
from zerofit.objectives.protocol import Objective
from zerofit.objectives.spec import EXAMPLE, PAIR, PROMPT, UNPAIRED, ObjectiveSpec
from zerofit.recipe.vision_settings import vision_processor_for
from zerofit.resolution import ResolvedConfig
from zerofit.strategies import build_strategy
from zerofit.strategies.base import Strategy
from zerofit.strategies.optim import build_optimizer, build_scheduler
from zerofit.token_loss.sums import IGNORE_INDEX

if TYPE_CHECKING:
    from zerofit.checkpoint.policy import EvalWatch, SaveClock
    from zerofit.harness.during import HarnessDuringTraining
    from zerofit.loop.reference import ReferencePass
    from zerofit.loop.rollout import Rollouts
    from zerofit.loop.signals import StopSignal
    from zerofit.metrics.base import MetricsSink

__all__ = ["PreparedRun", "TrainData", "assemble", "device_type"]


Units = (
    list[Example] | list[PreferencePair] | list[UnpairedExample]
)  # what the global batch counts: examples, or pairs


@dataclass
class TrainData:
    """The tokenized training data, what loading did to the source, the global-batch order, and the
    evaluation data (None without `data.eval_path` / `data.eval_split`).

    `examples` (and `eval_examples`) are `Example`s for `train.objective: sft`, `PreferencePair`s for a
    preference objective (one unit of the global batch each: the sampler counts pairs, never sequences).
    """

    examples: Units
    stats: DataStats
    sampler: GlobalBatchSampler
    eval_examples: Units | None = None
    eval_stats: DataStats | None = None

    @property
    def facts(self) -> DataFacts:
        """What this data decides for the run plan: its format and the optimizer steps of one epoch."""
        prompts = bool(self.examples) and isinstance(self.examples[0], PromptExample)
        fmt = "prompt" if prompts else self.stats.format  # GRPO's: a string or messages prompt alike
        return DataFacts(format=fmt, steps_per_epoch=self.sampler.steps_per_epoch)

    @property
    def mean_label_tokens(self) -> float:
        """Valid label tokens per unit of the global batch, on average (for the plan's tokens-per-step line):
        per example, or per pair (its chosen and rejected sequences together)."""
        valid = sum(_label_tokens(unit) for unit in self.examples)
        return valid / max(len(self.examples), 1)


def _label_tokens(unit: Example | PreferencePair) -> int:
    """Valid label tokens of one unit: an example's, or a pair's two sequences' together (a GRPO prompt's:
    none, its completions are sampled in the run)."""
    if isinstance(unit, PromptExample):
        return 0
    sequences = (unit.chosen, unit.rejected) if isinstance(unit, PreferencePair) else (unit,)
    # list.count runs in C: the plan's line costs milliseconds, not a Python loop over every label token
    return sum(len(e.labels) - e.labels.count(IGNORE_INDEX) for e in sequences)


@dataclass
class PreparedRun:
    """Everything a run trains with, built and wired: what `assemble` returns."""

    plan: RunPlan  # every decision of the launch (config, split, engine spec, run dir, resume point)
    strategy: Strategy
    built: BuiltModel
    model: torch.nn.Module  # what the loop calls: the engine-wrapped model
    data: TrainData | None  # None for synthetic-batch runs (the probe, the GPU benchmark)
    reference: ReferencePass | None = None  # the precomputed DPO reference's pass (or cache hit)
    teacher: torch.nn.Module | None = None  # distillation's frozen teacher (`zerofit.recipe.teacher`)

    @property
    def objective(self) -> Objective:
        """train.objective's loss for the loop and the evaluation (`ObjectiveSpec.build_loss`; a new one each
        time, as each holds its own per-window state: KTO's z0)."""
        loss = self.plan.objective.build_loss(self.plan.config)
        if self.teacher is not None:  # distillation's loss reads the teacher's logits
            loss.teacher = self.teacher  # type: ignore[attr-defined]
        return loss

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs to train one token of this model at max_seq_len (for MFU; see metrics.throughput)."""
        hf_config = self.built.model.config.get_text_config()  # peft forwards `.config` to the HF model
        return train_flops_per_token(
            self.built.total_params,
            self.built.trainable_params,
            n_layers=hf_config.num_hidden_layers,
            hidden=hf_config.hidden_size,
            seq_len=self.plan.config.data.max_seq_len,
        )

    def loop_inputs(
        self,
        sink: MetricsSink,
        checkpointer: CheckpointSaver,
        stop: StopSignal | None = None,
        clock: SaveClock | None = None,
        watch: EvalWatch | None = None,
    ) -> LoopInputs:
        """What the training loop needs of this run, logging to `sink`, checkpointing through `checkpointer`,
        and stopping (after a step, on every rank) when `stop` says a rank got SIGTERM/SIGINT. `clock`
        times `checkpoint.every_minutes` saves; `watch` judges evaluations (best checkpoint, early stop)."""
        if self.data is None:
            raise ValueError("assembled without data (with_data=False): there is nothing to train on")
        cfg = self.plan.config
        return LoopInputs(
            strategy=self.strategy,
            model=self.model,
            examples=self.data.examples,
            sampler=self.data.sampler,
            batch=self.plan.batch,
            max_steps=cfg.train.max_steps,
            max_grad_norm=cfg.train.max_grad_norm,
            pad_id=int(self.built.tokenizer.pad_token_id),
            sink=sink,
            checkpointer=checkpointer,
            log_every=cfg.logging.log_every,
            flops_per_token=self.flops_per_token,
            precision=cfg.train.precision,
            cross_entropy=cfg.train.cross_entropy,
            packed_row_tokens=cfg.data.max_seq_len if cfg.batch.tokens_per_micro_batch is not None else None,
            evaluator=self.evaluator(),
            harness=self.harness,
            stop=stop,
            clock=clock,
            watch=watch,
            keep_best=cfg.checkpoint.keep_best,
            objective=self.objective,
            compiled=self.built.compiled_layers > 0,
            run_dir=self.plan.run_dir,
            rollouts=self.rollouts,
            updates_per_rollout=self.plan.objective.updates_per_rollout(cfg),
        )

    @functools.cached_property
    def rollouts(self) -> Rollouts | None:
        """An objective that generates its sequences (GRPO): the run's rollouts (its reward functions, tools
        and environment built, so imported, here: only a training launch asks, `FinetuneRecipe.setup` before
        it writes or prints anything); None otherwise. A user error building them on any rank (a tool module
        that does not import, a first prompt too long, an environment whose reset raises) is agreed: every
        rank raises it, rank 0 says it once, and no rank waits for one that stopped."""
        if not self.plan.objective.generates or self.data is None:
            return None
        from zerofit.loop.environment import EnvironmentFailed
        from zerofit.loop.rollout import agree_on_failure

        built, failure = None, None
        try:
            built = self._build_rollouts(self.data)
        except EnvironmentFailed as exc:  # the data the run cannot use (the API's DataError)
            failure = DataError(str(exc))
        except ZerofitError as exc:
            failure = exc
        agree_on_failure(self.strategy, failure)
        return built

    def _build_rollouts(self, data: TrainData) -> Rollouts:
        """The rollouts `rollouts` agrees on: distillation's, or the objective's with its advantages."""
        from zerofit.recipe.distill import distill_rollouts
        from zerofit.recipe.rl import rollouts

        cfg = self.plan.config
        prompts: list[Any] = data.examples
        tokenizer = self.built.tokenizer
        if self.teacher is not None:  # distillation: the student's or the data's (or teacher's) completions
            model, split = self.built.model, self.plan.batch
            return distill_rollouts(cfg, tokenizer, model, prompts, data.sampler, split, self.teacher)
        objective = self.plan.objective
        estimator = objective.advantage_estimator(cfg)
        assert estimator is not None, "an objective that generates estimates its advantages"
        return rollouts(
            cfg,
            tokenizer,
            self.built.model,
            prompts,
            data.sampler,
            self.plan.batch,
            estimator,
            objective.reward_penalty(cfg),
        )

    @functools.cached_property
    def harness(self) -> HarnessDuringTraining | None:
        """`eval.harness`'s hook (`zerofit.recipe.harness`), one per run: the setup resolves its tasks."""
        from zerofit.recipe.harness import harness_for

        return harness_for(self.plan, self.strategy, self.built.tokenizer) if self.data is not None else None

    def evaluator(self) -> Evaluator | None:
        """The loop's evaluation hook, when the run has evaluation data."""
        if self.data is None or self.data.eval_examples is None:
            return None
        cfg = self.plan.config
        return Evaluator(
            strategy=self.strategy,
            model=self.model,
            examples=self.data.eval_examples,
            micro_batch_size=self.plan.batch.micro_batch_size,
            pad_id=int(self.built.tokenizer.pad_token_id),
            every_steps=cfg.eval.every_steps,
            max_steps=cfg.train.max_steps,
            cross_entropy=cfg.train.cross_entropy,
            objective=self.objective,
            rollouts=self.rollouts if self.plan.objective.rewarded else None,
            sampling=cfg.eval.sampling,
        )

    def record(self) -> dict[str, Any]:
        """Facts of this build for the run's W&B config and `run_info.json` (beyond the config and spec)."""
        out: dict[str, Any] = {
            "params_total": self.built.total_params,
            "params_trainable": self.built.trainable_params,
        }
        if self.built.compiled_layers:
            out["compiled_layers"] = self.built.compiled_layers
        if self.data is not None:
            out["data_stats"] = dataclasses.asdict(self.data.stats)
            if self.data.eval_stats is not None:
                out["eval_data_stats"] = dataclasses.asdict(self.data.eval_stats)
        return out

    def close(self) -> None:
        """Tear the engine's process group down; safe to call twice."""
        self.strategy.close()


def device_type() -> str:
    """The device this process trains on: `cuda` when one is visible, else `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rank0_first(strategy: Strategy, load: Callable[[bool], TokenizedData[Any]]) -> TokenizedData[Any]:
    """`load(is_rank0)` on rank 0, then on the others: rank 0 fills the tokenization cache (with progress),
    the others read it instead of tokenizing again. A DataError on rank 0 is raised on every rank.

    The others wait through the store, not inside a collective: tokenizing a large dataset can take longer
    than the process-group timeout (`distributed.timeout_minutes`)."""
    problem, data = None, None
    if strategy.rank == 0:
        try:
            data = load(True)
        except DataError as exc:
            problem = str(exc)
    strategy.wait_for_rank0("rank 0 to tokenize the data")
    problem = strategy.broadcast_object(problem)
    if problem is not None:
        raise DataError(problem)
    return data if data is not None else load(False)


def _tools(tools_file: str | None) -> list[dict[str, Any]] | None:
    """`data.tools_file`'s tools, or None when unset."""
    from zerofit.data.tools import read_tools_file

    return read_tools_file(tools_file) if tools_file else None


def _source_reader(
    cfg: ZerofitConfig,
    objective: ObjectiveSpec,
    tokenizer: Any,
    processor: Any,
    path: str,
    split: str,
    key: str,
) -> Callable[[bool], TokenizedData[Any]]:
    """The load of one source on rank 0 (then the others), by the objective's unit (`ObjectiveSpec.unit`);
    the training data's cut examples are held to `data.truncation` there, so a refusal is one message
    before any model loads. `processor`: a vision-language model's (`zerofit.recipe.vision_settings`), else None."""
    d = cfg.data
    options: dict[str, Any] = {
        "format": d.format,
        "split": split,
        "subset": d.subset,
        "cache": d.cache,
        "key": key,
        "empty_responses": d.empty_responses,
    }
    if processor is not None and objective.unit is PAIR:  # preference pairs with images (`data.vision_pairs`)
        from zerofit.data.vision_pairs import load_vision_pairs

        return lambda show: load_vision_pairs(
            path, processor, d.max_seq_len, split=split, subset=d.subset, key=key
        )
    if processor is not None:  # a vision-language model: image + text conversations (`data.vision`)
        from zerofit.data.vision import load_vision_examples

        return lambda show: load_vision_examples(path, processor, d.max_seq_len, split=split, subset=d.subset,
            key=key, empty_responses=d.empty_responses, missing_images=d.missing_images, cache=d.cache)  # fmt: skip
    if objective.unit is UNPAIRED:  # unpaired feedback; the training data must hold both labels
        both = key == "data.path" and split == d.split
        kto = {"split": split, "subset": d.subset, "cache": d.cache, "key": key}
        from zerofit.data.unpaired import load_unpaired, require_both_labels

        return lambda show: require_both_labels(
            load_unpaired(path, tokenizer, d.max_seq_len, progress=show, **kto), key, both
        )
    if objective.unit is EXAMPLE:  # data.tools_file read where the data is: rank 0 first, one message
        return lambda show: load_examples(
            path, tokenizer, d.max_seq_len, progress=show, tools=_tools(d.tools_file), **options
        )
    return lambda show: load_preference_pairs(
        path, tokenizer, d.max_seq_len, progress=show, objective=objective.name,
        whole_texts=objective.whole_texts, **options,
    )  # fmt: skip


def _load_data(resolved: ResolvedConfig, tokenizer: Any, strategy: Strategy) -> TrainData:
    """Training and evaluation data (`data.format: auto` detected per source; `TrainData.facts` says what
    the training data decided): examples for `train.objective: sft`, preference pairs for the others."""
    cfg, objective = resolved.config, resolved.objective
    d = cfg.data
    processor = vision_processor_for(cfg, tokenizer, objective)
    if objective.unit is PROMPT:  # prompts, rl.prompts_per_step of them per step (`zerofit.recipe.rl`)
        from zerofit.recipe.rl import load_prompt_data

        prompts, stats, sampler, held_prompts = load_prompt_data(cfg, tokenizer, processor)
        held_units: Any = held_prompts.examples if held_prompts is not None else None
        held_stats = held_prompts.stats if held_prompts is not None else None
        return TrainData(prompts, stats, sampler, held_units, held_stats)  # type: ignore[arg-type]
    reader = functools.partial(_source_reader, cfg, objective, tokenizer, processor)
    read_train = reader(d.path, d.split, "data.path")
    train = _rank0_first(
        strategy, lambda show: check_truncation(read_train(show), d.max_seq_len, d.truncation)
    )
    held: TokenizedData[Any] | None = None
    source = eval_source(d)
    if source is not None:
        path, split, key = source
        held = _rank0_first(strategy, reader(path, split, key))
    elif d.eval_split is not None:
        train, held = hold_out(train, d.eval_split, cfg.seed)
    if held is not None:
        check_eval_data(held.examples)  # 0 tokens to score: refused now, not a 0.0 "best" eval/loss later
    sampler = GlobalBatchSampler(
        len(train.examples), resolved.batch.global_batch_size, cfg.seed, d.shuffle, cfg.train.partial_window
    )
    return TrainData(
        train.examples,
        train.stats,
        sampler,
        held.examples if held is not None else None,
        held.stats if held is not None else None,
    )


def _check_device(resolved: ResolvedConfig, strategy: Strategy) -> None:
    """What the config cannot know: the loss kernel runs on this rank's device, and every rank sees the
    same output_dir (each writes its part of every checkpoint there), checked in seconds, before the data
    and a 7B load rather than at the first save."""
    cfg = resolved.config
    if cfg.train.cross_entropy == "liger" and strategy.device.type != "cuda":
        raise LaunchError(
            f"train.cross_entropy = 'liger' runs Triton kernels on CUDA, and this rank trains on "
            f"{strategy.device}; use train.cross_entropy=chunked (the default: the same token sums in "
            "pure PyTorch)"
        )
    if cfg.train.kernels != "none" and strategy.device.type != "cuda":
        raise LaunchError(
            f"train.kernels = {cfg.train.kernels!r} runs Liger's Triton kernels on CUDA, and this rank trains on "
            f"{strategy.device}; run on a CUDA device (pip install 'zerofit[liger]' there), or "
            "train.kernels=none (the same token sums in PyTorch)"
        )
    check_shared_output_dir(strategy, Path(cfg.output_dir))


def _model_and_engine(
    plan: RunPlan, strategy: Strategy, tokenizer: Any
) -> tuple[BuiltModel, torch.nn.Module]:
    """The model as the plan says (seeded, quantized on its GPU), wrapped by the engine with its optimizer
    and schedule."""
    # accelerate's set_seed (accelerate comes with peft) seeds what transformers' does (random, numpy, torch,
    # every CUDA device); transformers' lives in trainer_utils, which imports peft and with it bitsandbytes,
    # whose import compiles kernels through torch.compile: ~1 s of CPU per rank that a run without LoRA
    # or 8-bit optimizers never needed. (A LoRA run imports peft when it applies the adapters.)
    from accelerate.utils import set_seed

    cfg = plan.config
    set_seed(cfg.seed)  # the same LoRA init and dropout stream on every rank and every split
    # Quantized weights are quantized on the GPU they will live on, at load time (one GPU per rank).
    on_gpu = strategy.device.type == "cuda" and cfg.quantization.load_in != "none"
    built = build_model(cfg, device_map={"": strategy.device.index} if on_gpu else None, tokenizer=tokenizer)
    make_optimizer = (
        None if plan.spec.builds_optimizer else lambda m: build_optimizer(m, cfg, plan.effective_lr)
    )
    assert cfg.train.max_steps is not None, "a run plan knows its step count"
    # The schedule spans every optimizer update: a loop step takes more than one on a reused rollout (GRPO).
    updates = cfg.train.max_steps * plan.objective.updates_per_rollout(cfg)
    model = strategy.prepare(built.model, make_optimizer, lambda opt: build_scheduler(opt, cfg, updates))
    return built, model


def _reference_pass(
    plan: RunPlan, strategy: Strategy, model: torch.nn.Module, data: TrainData | None, pad_id: int
) -> ReferencePass | None:
    """`preference.reference: precomputed`: the reference log-probs of every training and eval pair, from
    the model as loaded (before any checkpoint is restored) or the cache (`zerofit.loop.reference`)."""
    cfg = plan.config
    if data is None or not plan.objective.precomputes_reference(cfg):
        return None
    pairs: list[Any] = [*data.examples, *(data.eval_examples or [])]
    from zerofit.loop.reference import precompute_reference

    return precompute_reference(cfg, strategy, model, pairs, plan.batch.micro_batch_size, pad_id)


def assemble(
    resolved: ResolvedConfig, *, with_data: bool = True, config_file: str | None = None
) -> PreparedRun:
    """Build the run `resolved` describes, ready for `train_loop` (collective: every rank calls it).

    `with_data=False` skips the data (the probe and the GPU benchmark feed synthetic batches). On any
    failure the engine's process group is torn down before the error propagates. `config_file`: the file
    the launch read (None: a config built in code), which a resume compares with its checkpoint's.
    """
    cfg = resolved.config
    if not with_data and cfg.train.max_steps is None:
        raise LaunchError(
            f"train.epochs = {cfg.train.epochs}: this entry point feeds synthetic batches and loads no "
            "data, so an epoch has no length; set train.max_steps instead"
        )
    spec = render_spec(resolved, device_type())
    strategy = build_strategy(spec)
    try:
        # The run directory and any checkpoint to resume are settled (and refused) before the data and
        # the model: a bad resume costs seconds.
        decision = settle_run_dir(resolved, strategy, config_file)
        _check_device(resolved, strategy)
        # Data first (it needs only the tokenizer): a bad line fails in seconds, not after a 7B load.
        tokenizer = load_tokenizer(cfg)
        set_chat_template(tokenizer, cfg.data.chat_template)  # exported with it, for generation later
        data = _load_data(resolved, tokenizer, strategy) if with_data else None
        plan = make_run_plan(resolved, spec, decision, data.facts if data is not None else None)
        built, model = _model_and_engine(plan, strategy, tokenizer)
        reference = _reference_pass(plan, strategy, model, data, int(tokenizer.pad_token_id))
        teacher = None
        if plan.objective.teacher_model(plan.config) is not None:  # after the student: its seed first
            from zerofit.recipe.teacher import load_teacher

            teacher = load_teacher(plan.config, tokenizer, strategy.device)
        return PreparedRun(plan, strategy, built, model, data, reference, teacher)
    except BaseException:
        strategy.close()
        raise
