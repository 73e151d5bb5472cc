"""What does zerofit's training loop cost per step over the plain PyTorch loop a user would write?

Both loops train the same model (zerofit's built by `zerofit.recipe.assembly.assemble`, the reference's by
`zerofit.models.build.build_model` from the same seed, so the same LoRA init), on the same global batches in the
same order, split into the same micro-batches, with the same optimizer and LR schedule (`zerofit.strategies.optim`),
in this one process:

  zerofit    the run exactly as the launcher assembles it for distributed.strategy=single under plain
             `python` (`SingleStrategy`) + `zerofit.loop.train.train_loop`, with a discarding metrics sink and a
             checkpointer that only timestamps steps. So everything the loop does per step is timed: batch assembly, the
             token count, the token-exact loss, the strategy's verbs, the metrics dict and memory snapshot.
  reference  for each micro-batch: `model(**batch).loss / grad_accum_steps`, backward; then
             `clip_grad_norm_`, `optimizer.step()`, `scheduler.step()`, `zero_grad()`. Its micro-batches are
             built with the same collate inside the timed step, as a user's DataLoader would.

The two alternate in segments (zerofit, reference, zerofit, reference, ... over --repeats), each segment
--steps optimizer steps, after --warmup untimed steps each (the first step allocates optimizer state), so
machine noise (a shared CPU) falls on both. Each step is timed twice: wall time and this process's CPU time
(`time.process_time`; on a shared CPU it leaves out the time other processes held the core, so with one
thread, `--threads 1`, it is the steadier measure; on a GPU only the wall time means anything). Reported:
the median step time of each (wall and CPU), tokens/s (input tokens of the timed steps / their total wall
time), the ratios zerofit / reference (of the medians, and per repeat), and the loss of each after the
last step. The two losses mean different things: zerofit's is token-exact (sum of token losses / valid
tokens of the whole global batch); the reference's is the mean of the micro-batches' own token means.

This is a measurement, not a test: nothing here asserts on time.

    python benchmarks/overhead_vs_torch.py                            # demo recipe, one process, fp32
    python benchmarks/overhead_vs_torch.py --steps 20 --repeats 3 --json out.json
    python benchmarks/overhead_vs_torch.py --threads 1 --steps 10 --repeats 30   # a shared CPU: CPU time
    python benchmarks/overhead_vs_torch.py --micro 2 --global-batch 16 lora.r=8

Run from the repository root (the config's data path is relative to it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerofit.core.precision import torch_dtype
from zerofit.loop.train import CheckpointSaver

if TYPE_CHECKING:
    from zerofit.data import Example, GlobalBatchSampler
    from zerofit.recipe.assembly import PreparedRun
    from zerofit.resolution import ResolvedConfig
    from zerofit.strategies.base import Strategy

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "demo.yaml"
# The demo recipe (tiny-llama + LoRA) in one process; precision and the batch come from the flags.
SINGLE_PROCESS = ["distributed.strategy=single", "distributed.preset=null", "logging.wandb.mode=disabled"]


# ------------------------------------------------------------------------------------------ setup


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Flags of the benchmark; trailing `dotted.key=value` overrides apply to the config like the launcher's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config YAML (default: demo)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per segment")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per loop before the first segment"
    )
    parser.add_argument("--repeats", type=int, default=3, help="segments per loop, alternating the two")
    parser.add_argument("--micro", type=int, default=None, help="batch.micro_batch_size (default: config's)")
    parser.add_argument("--global-batch", type=int, default=None, help="batch.global_batch_size")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="train.precision"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result to this JSON file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. lora.r=8 data.max_seq_len=128")
    args = parser.parse_intermixed_args(argv)
    for name in ("steps", "repeats", "threads"):
        if (getattr(args, name) or 1) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def total_steps(args: argparse.Namespace) -> int:
    """Optimizer steps each loop runs: warm-up plus every timed segment (the LR schedule spans them)."""
    return args.warmup + args.repeats * args.steps


def config_overrides(args: argparse.Namespace) -> list[str]:
    """One process + the flags, then the user's overrides (which win), then the step count (fixed here)."""
    flags = [f"train.precision={args.precision}"]
    if args.micro is not None:
        flags.append(f"batch.micro_batch_size={args.micro}")
    if args.global_batch is not None:
        flags.append(f"batch.global_batch_size={args.global_batch}")
    return [*SINGLE_PROCESS, *flags, *args.overrides, f"train.max_steps={total_steps(args)}"]


def resolve_config(args: argparse.Namespace) -> ResolvedConfig:
    """The config resolved for one plain-`python` process; refuses anything but strategy=single."""
    from zerofit.config import load_config
    from zerofit.core.errors import ConfigError, LaunchError
    from zerofit.resolution import resolve
    from zerofit.strategies.env import launch_env

    env = launch_env()
    if env.world_size != 1:
        raise LaunchError(
            f"WORLD_SIZE = {env.world_size}: this benchmark runs in one process; start it with plain "
            "`python benchmarks/overhead_vs_torch.py`, not under torchrun or deepspeed"
        )
    resolved = resolve(load_config(args.config, config_overrides(args)), env.world_size)
    if resolved.config.distributed.strategy != "single":
        raise ConfigError(
            [
                f"distributed.strategy = {resolved.config.distributed.strategy!r}: this benchmark compares "
                "the one-process loop with plain PyTorch; drop the distributed.strategy override"
            ]
        )
    return resolved


@dataclass
class Workload:
    """The data both loops train on: tokenized examples, the global-batch order and the pad id."""

    resolved: ResolvedConfig
    examples: list[Example]
    sampler: GlobalBatchSampler
    pad_id: int

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Global batch `step` split into micro-batches exactly as zerofit splits it for one rank."""
        from zerofit.data import collate, split_global_batch

        p = self.resolved.batch
        split = split_global_batch(
            self.sampler.batch_indices(step), p.micro_batch_size, p.grad_accum_steps, 1, 0
        )
        return [collate([self.examples[i] for i in ids], self.pad_id) for ids in split]

    def input_tokens(self, step: int) -> int:
        """Tokens the model computes on in global batch `step` (padding excluded)."""
        return sum(int(b["attention_mask"].sum()) for b in self.micro_batches(step))


def build_reference_model(resolved: ResolvedConfig) -> torch.nn.Module:
    """The config's model as `assemble` builds it (same seed: identical weights and adapters), unwrapped."""
    from transformers import set_seed

    from zerofit.models.build import build_model

    set_seed(resolved.config.seed)
    return build_model(resolved.config).model


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so a timestamp means the step is done (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ the two loops


def clocks() -> tuple[float, float]:
    """Now, as (wall seconds, this process's CPU seconds): a step is timed on both."""
    return time.perf_counter(), time.process_time()


@dataclass
class Segment:
    """One timed run of consecutive steps: each step's wall and CPU seconds, and the loss after the last one."""

    seconds: list[float]
    cpu_seconds: list[float]
    last_loss: float

    @classmethod
    def from_marks(cls, marks: list[tuple[float, float]], last_loss: float) -> Segment:
        """The steps between consecutive `clocks()` marks."""
        pairs = list(itertools.pairwise(marks))
        return cls([b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs], last_loss)


class StepClock(CheckpointSaver):
    """A checkpointer that saves nothing: `train_loop` calls it once at the end of every step, so the time
    between calls is the loop's whole per-step cost (batches, step, metrics, memory snapshot).

    It subclasses the loop's protocol and accepts whatever the loop passes after `steps_done`, so a change
    to the protocol cannot break it (the loop's `stopping` argument once broke `workloads.py`'s hook)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[float, float]] = []

    def after_step(self, steps_done: int, *args: Any, **kwargs: Any) -> None:
        del steps_done, args, kwargs
        synchronize(self.device)
        self.marks.append(clocks())


class ZerofitLoop:
    """zerofit's own path: the assembled run + `train_loop`, metrics computed and discarded."""

    def __init__(self, prepared: PreparedRun) -> None:
        from zerofit.metrics.base import NullSink

        self.prepared = prepared
        self.strategy: Strategy = prepared.strategy
        self.clock = StepClock(self.strategy.device)
        self.run = prepared.loop_inputs(NullSink(), self.clock)
        self.run.max_steps = 0  # set per segment

    def segment(self, start: int, steps: int) -> Segment:
        """Steps `start`..`start + steps - 1` through `train_loop`, timed by the step clock."""
        from zerofit.loop.train import train_loop

        self.run.max_steps = start + steps
        self.clock.marks = [clocks()]
        results = train_loop(self.run, start_step=start)
        return Segment.from_marks(self.clock.marks, results[-1].loss)

    def close(self) -> None:
        self.prepared.close()


class ReferenceLoop:
    """The textbook loop: HF's mean loss per micro-batch / accumulation steps, clip, step, schedule, zero."""

    def __init__(self, model: torch.nn.Module, work: Workload, device: torch.device) -> None:
        from zerofit.strategies.optim import build_optimizer, build_scheduler

        cfg = work.resolved.config
        self.work, self.device = work, device
        self.model = model.to(device)
        self.optimizer = build_optimizer(model, cfg, work.resolved.effective_lr)
        self.scheduler = build_scheduler(self.optimizer, cfg, cfg.train.max_steps)
        self.max_grad_norm = cfg.train.max_grad_norm
        # Mixed precision as a user would add it: autocast, and a GradScaler for fp16.
        self.dtype = None if cfg.train.precision == "fp32" else torch_dtype(cfg.train.precision)
        self.scaler = torch.amp.GradScaler(device.type) if self.dtype == torch.float16 else None

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def step(self, step: int) -> float:
        """One optimizer step on global batch `step`; returns the sum of (micro-batch mean loss / GAS)."""
        batches = self.work.micro_batches(step)
        gas = len(batches)
        total = 0.0
        for batch in batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with self._autocast():
                loss = self.model(**batch).loss / gas
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.item()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def segment(self, start: int, steps: int) -> Segment:
        """Steps `start`..`start + steps - 1`, each timed on its own."""
        marks, loss = [clocks()], float("nan")
        for step in range(start, start + steps):
            loss = self.step(step)
            synchronize(self.device)
            marks.append(clocks())
        return Segment.from_marks(marks, loss)


# ------------------------------------------------------------------------------------------ measuring


@dataclass
class LoopStats:
    """One loop's timed steps summarized."""

    median_step_s: float
    median_step_cpu_s: float
    per_repeat_median_s: list[float]
    per_repeat_median_cpu_s: list[float]
    tokens_per_s: float
    loss_after: float
    step_seconds: list[float] = field(repr=False)
    step_cpu_seconds: list[float] = field(repr=False)


def summarize(segments: list[Segment], tokens: int) -> LoopStats:
    """Medians over every timed step (wall, CPU), per-segment medians, throughput = timed tokens / wall seconds."""
    every = [s for seg in segments for s in seg.seconds]
    every_cpu = [s for seg in segments for s in seg.cpu_seconds]
    return LoopStats(
        median_step_s=statistics.median(every),
        median_step_cpu_s=statistics.median(every_cpu),
        per_repeat_median_s=[statistics.median(seg.seconds) for seg in segments],
        per_repeat_median_cpu_s=[statistics.median(seg.cpu_seconds) for seg in segments],
        tokens_per_s=tokens / sum(every),
        loss_after=segments[-1].last_loss,
        step_seconds=every,
        step_cpu_seconds=every_cpu,
    )


def _ms(segment: Segment) -> str:
    """A segment's median step, wall / CPU, in ms."""
    wall, cpu = statistics.median(segment.seconds), statistics.median(segment.cpu_seconds)
    return f"{1e3 * wall:.1f} / {1e3 * cpu:.1f} ms"


def measure(
    args: argparse.Namespace, work: Workload, zerofit: ZerofitLoop, reference: ReferenceLoop
) -> tuple[LoopStats, LoopStats]:
    """Warm both up, then alternate timed segments (zerofit, reference, ...); both see the same steps."""
    if args.warmup:
        zerofit.segment(0, args.warmup)
        reference.segment(0, args.warmup)
    z_segments, r_segments, tokens = [], [], 0
    for repeat in range(args.repeats):
        start = args.warmup + repeat * args.steps
        z_segments.append(zerofit.segment(start, args.steps))
        r_segments.append(reference.segment(start, args.steps))
        tokens += sum(work.input_tokens(s) for s in range(start, start + args.steps))
        print(
            f"  repeat {repeat + 1}/{args.repeats}: zerofit {_ms(z_segments[-1])}, reference"
            f" {_ms(r_segments[-1])} (median step, wall / CPU)",
            flush=True,
        )
    return summarize(z_segments, tokens), summarize(r_segments, tokens)


# ------------------------------------------------------------------------------------------ reporting


def host_cpu() -> str:
    """The CPU model name (Linux /proc/cpuinfo; `platform.processor()` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {host_cpu()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def report(
    args: argparse.Namespace, work: Workload, device: torch.device, z: LoopStats, r: LoopStats
) -> dict[str, Any]:
    """Everything a result file records: when, where, what was run, and the numbers."""
    cfg, plan = work.resolved.config, work.resolved.batch
    paired = _paired(z.per_repeat_median_s, r.per_repeat_median_s)
    paired_cpu = _paired(z.per_repeat_median_cpu_s, r.per_repeat_median_cpu_s)
    return {
        "script": "benchmarks/overhead_vs_torch.py",
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "config": {
            "path": _repo_relative(args.config),
            "overrides": config_overrides(args),
            "model": cfg.model.name_or_path,
            "method": work.resolved.method,
            "precision": cfg.train.precision,
            "batch": plan.describe(),
            "max_seq_len": cfg.data.max_seq_len,
        },
        "steps_per_segment": args.steps,
        "warmup_steps": args.warmup,
        "repeats": args.repeats,
        "zerofit": _rounded(asdict(z)),
        "reference": _rounded(asdict(r)),
        "ratio_median_step": round(z.median_step_s / r.median_step_s, 4),
        "ratio_per_repeat": [round(x, 4) for x in paired],
        "ratio_median_step_cpu": round(z.median_step_cpu_s / r.median_step_cpu_s, 4),
        "ratio_per_repeat_cpu": [round(x, 4) for x in paired_cpu],
        "ratio_per_repeat_median": round(statistics.median(paired), 4),
        "ratio_per_repeat_median_cpu": round(statistics.median(paired_cpu), 4),
        "loss_note": "zerofit: sum of token losses / valid tokens of the global batch (token-exact); "
        "reference: sum over micro-batches of (micro-batch token mean / grad_accum_steps)",
    }


def _paired(zerofit: list[float], reference: list[float]) -> list[float]:
    """zerofit / reference of each repeat's medians (the two segments of a repeat ran back to back)."""
    return [a / b for a, b in zip(zerofit, reference, strict=True)]


def _repo_relative(path: str) -> str:
    """`path` relative to the repository when it lies inside it (result files should not name a home)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else path


def _rounded(stats: dict[str, Any]) -> dict[str, Any]:
    """Seconds to 10 us, losses to 4 decimals, tokens/s to 1 (a result file to read, not a float dump)."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        digits = 4 if key == "loss_after" else 5
        if isinstance(value, list):
            out[key] = [round(v, digits) for v in value]
        else:
            out[key] = round(value, 1) if key == "tokens_per_s" else round(value, digits)
    return out


def format_summary(result: dict[str, Any]) -> str:
    """The printed table: both loops, the ratio, and what each loss means."""
    z, r, c = result["zerofit"], result["reference"], result["config"]
    steps = result["warmup_steps"] + result["repeats"] * result["steps_per_segment"]
    lines = [
        f"overhead vs plain PyTorch: {c['model']} {c['method']} {c['precision']}, {c['batch']}, "
        f"seq <= {c['max_seq_len']}, on {result['device']}",
        f"  {result['repeats']} x {result['steps_per_segment']} timed steps per loop, alternating; "
        f"warm-up steps: {result['warmup_steps']} each",
        f"  {'':10s} {'median step':>12s} {'(CPU)':>10s} {'tokens/s':>10s} {f'loss after {steps} steps':>22s}",
    ]
    for name, s in (("zerofit", z), ("reference", r)):
        lines.append(
            f"  {name:10s} {1e3 * s['median_step_s']:9.2f} ms {1e3 * s['median_step_cpu_s']:7.2f} ms"
            f" {s['tokens_per_s']:10.0f} {s['loss_after']:22.4f}"
        )
    lines += [
        f"  ratio zerofit / reference (median step time): {result['ratio_median_step']:.3f}"
        f"  ({_spread(result['ratio_per_repeat'], result['ratio_per_repeat_median'])})",
        f"  ratio zerofit / reference (median step CPU time): {result['ratio_median_step_cpu']:.3f}"
        f"  ({_spread(result['ratio_per_repeat_cpu'], result['ratio_per_repeat_median_cpu'])})",
        "  losses differ in meaning: zerofit's is token-exact (all token losses of the global batch / its "
        "valid tokens);",
        "  the reference's is the mean of per-micro-batch token means (what `loss / grad_accum_steps` gives).",
    ]
    return "\n".join(lines)


def _spread(per_repeat: list[float], median: float) -> str:
    """The per-repeat ratios: each of a few, else their median and range."""
    if len(per_repeat) <= 6:
        return "per repeat: " + ", ".join(f"{x:.3f}" for x in per_repeat)
    return f"per repeat: median {median:.3f}, {min(per_repeat):.3f} to {max(per_repeat):.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from zerofit.core.errors import ZerofitError
    from zerofit.core.messages import error, quiet_libraries
    from zerofit.recipe.assembly import assemble

    quiet_libraries()
    try:
        resolved = resolve_config(args)
        prepared = assemble(resolved)
    except ZerofitError as exc:
        error("overhead_vs_torch", exc)
        return 2
    if args.threads is not None:  # after assemble: the strategy sets its own share of the cores
        torch.set_num_threads(args.threads)
    zerofit = ZerofitLoop(prepared)
    try:
        assert prepared.data is not None
        pad_id = int(prepared.built.tokenizer.pad_token_id)
        work = Workload(resolved, prepared.data.examples, prepared.data.sampler, pad_id)
        reference = ReferenceLoop(build_reference_model(resolved), work, zerofit.strategy.device)
        z, r = measure(args, work, zerofit, reference)
    finally:
        zerofit.close()
    result = report(args, work, zerofit.strategy.device, z, r)
    print(format_summary(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
