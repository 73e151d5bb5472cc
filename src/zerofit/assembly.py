"""One assembly for every real run: resolved config -> engine spec -> strategy -> run directory -> data ->
model -> optimizer and scheduler -> a prepared run.

The launcher, the GPU probe (`zerofit plan --probe`) and both benchmarks build their runs here and only
here, so what the probe and the benchmarks measure is exactly what a run does: the same spec, the same
seed before the model, quantized weights placed on the rank's GPU at load time, the same answer to "who
builds the optimizer".

The order is the user's: the tokenizer and the data come before the model, so a bad data file fails in
seconds rather than after a 7B load; the run directory (and the checkpoint a resume starts from) is
settled before either, once, on rank 0, for every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zerofit.checkpoint.resume import ResumePoint, settle_run_dir
from zerofit.config.resolve import ResolvedConfig
from zerofit.data import DataStats, Example, GlobalBatchSampler, load_sft_dataset
from zerofit.engine import EngineSpec, render_spec
from zerofit.loss import IGNORE_INDEX
from zerofit.metrics.throughput import train_flops_per_token
from zerofit.model import BuiltModel, build_model, load_tokenizer
from zerofit.optim import build_optimizer, build_scheduler
from zerofit.strategies import build_strategy
from zerofit.strategies.base import Strategy
from zerofit.train import Checkpointing, TrainRun

if TYPE_CHECKING:
    from zerofit.metrics.base import MetricsSink
    from zerofit.signals import StopSignal

__all__ = ["PreparedRun", "TrainData", "assemble", "device_type"]


@dataclass
class TrainData:
    """The tokenized training examples, what loading did to the file, and the global-batch order."""

    examples: list[Example]
    stats: DataStats
    sampler: GlobalBatchSampler

    @property
    def mean_label_tokens(self) -> float:
        """Valid label tokens per example, on average (for the plan's tokens-per-step line)."""
        valid = sum(sum(label != IGNORE_INDEX for label in e.labels) for e in self.examples)
        return valid / max(len(self.examples), 1)


@dataclass
class PreparedRun:
    """Everything a run trains with, built and wired: what `assemble` returns."""

    resolved: ResolvedConfig
    spec: EngineSpec
    strategy: Strategy
    built: BuiltModel
    model: torch.nn.Module  # what the loop calls: the engine-wrapped model
    data: TrainData | None  # None for synthetic-batch runs (the probe, the GPU benchmark)
    resume: ResumePoint | None = None  # the verified checkpoint to load, decided before the model load

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs to train one token of this model at max_seq_len (for MFU; see metrics.throughput)."""
        hf_config = self.built.model.config  # peft forwards `.config` to the wrapped HF model
        return train_flops_per_token(
            self.built.total_params,
            self.built.trainable_params,
            n_layers=hf_config.num_hidden_layers,
            hidden=hf_config.hidden_size,
            seq_len=self.resolved.config.data.max_seq_len,
        )

    def train_run(
        self, sink: MetricsSink, checkpointer: Checkpointing, stop: StopSignal | None = None
    ) -> TrainRun:
        """The training loop's view of this run, logging to `sink`, checkpointing through `checkpointer`,
        and stopping (after a step, on every rank) when `stop` says a rank got SIGTERM/SIGINT."""
        if self.data is None:
            raise ValueError("assembled without data (with_data=False): there is nothing to train on")
        cfg = self.resolved.config
        return TrainRun(
            strategy=self.strategy,
            model=self.model,
            examples=self.data.examples,
            sampler=self.data.sampler,
            plan=self.spec.plan,
            max_steps=cfg.train.max_steps,
            max_grad_norm=cfg.train.max_grad_norm,
            pad_id=int(self.built.tokenizer.pad_token_id),
            sink=sink,
            checkpointer=checkpointer,
            log_every=cfg.logging.log_every,
            flops_per_token=self.flops_per_token,
            precision=cfg.train.precision,
            stop=stop,
        )

    def record(self) -> dict[str, Any]:
        """Facts of this build for the run's W&B config and `run_info.json` (beyond the config and spec)."""
        out: dict[str, Any] = {
            "params_total": self.built.total_params,
            "params_trainable": self.built.trainable_params,
        }
        if self.data is not None:
            out["data_stats"] = dataclasses.asdict(self.data.stats)
        return out

    def close(self) -> None:
        """Tear the engine's process group down; safe to call twice."""
        self.strategy.close()


def device_type() -> str:
    """The device this process trains on: `cuda` when one is visible, else `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_data(resolved: ResolvedConfig, tokenizer: Any) -> TrainData:
    cfg = resolved.config
    examples, stats = load_sft_dataset(cfg.data.path, tokenizer, cfg.data.max_seq_len)
    sampler = GlobalBatchSampler(
        len(examples), resolved.plan.global_batch_size, cfg.seed, cfg.data.shuffle, cfg.train.partial_window
    )
    return TrainData(examples, stats, sampler)


def assemble(resolved: ResolvedConfig, *, with_data: bool = True) -> PreparedRun:
    """Build the run `resolved` describes, ready for `train_loop` (collective: every rank calls it).

    `with_data=False` skips the data (the probe and the GPU benchmark feed synthetic batches). On any
    failure the engine's process group is torn down before the error propagates.
    """
    from transformers import set_seed

    spec = render_spec(resolved, device_type())
    strategy = build_strategy(spec)
    try:
        # The run directory and any checkpoint to resume are settled (and refused) before the data and
        # the model: a bad resume costs seconds.
        resolved, resume = settle_run_dir(resolved, strategy)
        cfg = resolved.config
        # Data first (it needs only the tokenizer): a bad line fails in seconds, not after a 7B load.
        tokenizer = load_tokenizer(cfg)
        data = _load_data(resolved, tokenizer) if with_data else None
        set_seed(cfg.seed)  # the same LoRA init and dropout stream on every rank and every split
        # Quantized weights are quantized on the GPU they will live on, at load time (one GPU per rank).
        on_gpu = strategy.device.type == "cuda" and cfg.quantization.load_in != "none"
        built = build_model(
            cfg, device_map={"": strategy.device.index} if on_gpu else None, tokenizer=tokenizer
        )
        make_optimizer = (
            None if spec.builds_optimizer else lambda m: build_optimizer(m, cfg, resolved.effective_lr)
        )
        model = strategy.prepare(
            built.model, make_optimizer, lambda opt: build_scheduler(opt, cfg, cfg.train.max_steps)
        )
        return PreparedRun(resolved, spec, strategy, built, model, data, resume)
    except BaseException:
        strategy.close()
        raise
