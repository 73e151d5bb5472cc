"""GRPO rollouts against TRL: completion tokens generated per CPU-second, zerofit vs TRL's GRPOTrainer.

The same model (loaded twice from the same folder: zerofit's copy and TRL's), the same prompts (the first
`--prompts` of `data/demo_grpo.jsonl`, raw text, or with `--chat` one user message each through the
tokenizer's chat template), G completions each, the same maximum completion length, temperature 1, top_p 1,
top_k 0, full weights (no LoRA), fp32 on both sides (TRL's `bf16` default off), one torch thread:

    generation   zerofit's `zerofit.loop.rollout.sample_completions` (the rollout's sampler: one batched
                 forward per token over the rows still sampling, each completion's noise drawn in one call)
                 against TRL 1.16's `GRPOTrainer._generate` (its transformers-`generate` path: tokenize, the
                 prompts' batch through `model.generate`, the completions cut at their eos), on the G x
                 prompts completions of one step.
    whole step   one GRPO optimizer step, rollout and update (DAPO's loss, beta 0, Adam lr 1e-6, micro 8 x
                 accumulation G x prompts / 8): zerofit's `Rollouts.step_batches` + `train_step` on a
                 one-process engine against one step of `GRPOTrainer.train` (its step callback's window).

Each measure is CPU seconds (`time.process_time`) of the segment, and completion tokens are the sampled
tokens (an eos included; each side's own lengths). The two sides alternate in segments (`--repeats`, the
order swapped every repeat) so machine noise falls on both; the ratio is zerofit / TRL of the median tokens
per CPU-second, with the median of the paired ratios beside it.

The ceiling is measured, not asserted: during the generation segments each side's model `forward` is timed
(`ForwardClock`: CPU seconds inside the top-level call, everything the model computes, its matmuls, attention,
KV cache and mask building), so each side's CPU splits into the model's forward and everything else (the
sampler, the draw, generate's logits processors and bookkeeping). `ceiling_gen` is zerofit's tokens per
forward-CPU-second over TRL's tokens per CPU-second: the ratio zerofit would reach if everything outside the
forward cost nothing; and `ceiling_gen_same_forward` the same with TRL's own forward cost per token (what
the ratio could be if both sides ran the forward alike and zerofit did nothing else).

    python benchmarks/rollout_vs_trl.py --json benchmarks/results/rollout_vs_trl-<date>.json
    python benchmarks/rollout_vs_trl.py --models tiny-llama --repeats 5
    python benchmarks/rollout_vs_trl.py --models smollm2-135m-instruct --chat   # prompts through the chat template
    python benchmarks/rollout_vs_trl.py --smoke        # tiny-llama, 4 tokens, one repeat: checks the script
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "data" / "demo_grpo.jsonl"
MODELS = ("tiny-llama", "smollm2-135m-instruct")
SEED = 1234


def load(name: str) -> tuple[Callable[[], torch.nn.Module], Any]:
    """A loader of the built-in model `name` (each call a fresh fp32 copy of the same weights) and its
    tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerofit.models.pretrained import ensure_pretrained
    from zerofit.models.tiny import build_tokenizer, ensure_tiny_llama

    tiny = name == "tiny-llama"
    path = ensure_tiny_llama() if tiny else ensure_pretrained(name)
    tokenizer = build_tokenizer() if tiny else AutoTokenizer.from_pretrained(path)
    return lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train(), tokenizer


def prompt_rows(count: int, chat: bool = False) -> list[dict[str, Any]]:
    """The first `count` rows of the demo's GRPO prompts ({prompt, answer}); with `chat`, each prompt as one
    user message (TRL's conversational layout: its chat template is applied)."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:count]
    if chat:
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"].strip()}]} for r in rows]
    return rows


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """A prompt's token ids as TRL's GRPOTrainer makes them: the raw text, or a conversation through the
    tokenizer's chat template with the generation prompt."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(tokenizer: Any, model: torch.nn.Module) -> tuple[int, ...]:
    """The tokens that end a completion, as a zerofit run reads them (`zerofit.recipe.rl.end_ids`)."""
    from zerofit.recipe.rl import end_ids

    return end_ids(tokenizer, model)


class Zerofit:
    """zerofit's side: the sampler alone, and whole GRPO steps on a one-process engine."""

    def __init__(self, make: Callable[[], torch.nn.Module], tokenizer: Any, args: argparse.Namespace) -> None:
        from zerofit.loop.rollout import SamplingSettings

        self.model, self.tokenizer, self.args = make(), tokenizer, args
        self.rows = prompt_rows(args.prompts, args.chat)
        self.ids = [prompt_ids(tokenizer, r["prompt"]) for r in self.rows]
        self.settings = SamplingSettings(
            args.tokens, eos_ids(tokenizer, self.model), int(tokenizer.pad_token_id), 1.0, 1.0, 0
        )
        self.rollouts, self.strategy, self.step_no = self._rollouts(), self._strategy(), 0

    def generate(self, repeat: int) -> int:
        """One step's completions through the rollout's sampler: the tokens sampled."""
        from zerofit.loop.rollout import completion_seed, sample_completions

        g, n = self.args.g, len(self.ids)
        seeds = [completion_seed(SEED, repeat, c) for c in range(g * n)]
        prompts = [self.ids[c // g] for c in range(g * n)]
        sampled = sample_completions(self.model, prompts, seeds, self.settings, torch.device("cpu"))
        return sum(len(s.ids) for s in sampled)

    def step(self) -> int:
        """One whole GRPO step (rollout, rewards, advantages, update): the completion tokens sampled."""
        from zerofit.loop.train import train_step
        from zerofit.objectives.grpo.loss import GRPOObjective, GRPOSettings

        objective = GRPOObjective(GRPOSettings("dapo", 0.0, 0.2, 0.28, self.args.tokens))
        batches, metrics = self.rollouts.step_batches(self.strategy, self.model, self.step_no)
        train_step(self.strategy, self.model, batches, 1.0, "chunked", objective)
        self.step_no += 1
        return round(metrics["completions/mean_length"] * self.args.g * len(self.ids))

    def _rollouts(self) -> Any:
        from zerofit.config.batching import BatchSplit
        from zerofit.data import GlobalBatchSampler
        from zerofit.data.prompts import PromptExample
        from zerofit.loop.rollout import Rollouts

        g, n = self.args.g, len(self.ids)
        prompts = [
            PromptExample(ids, self.tokenizer.decode(ids), {"answer": r["answer"]}, i)
            for i, (r, ids) in enumerate(zip(self.rows, self.ids, strict=True))
        ]
        score = exact_match_scorer()
        return Rollouts(
            prompts=prompts,
            sampler=GlobalBatchSampler(n, n, seed=SEED),
            batch=BatchSplit(g * n, min(8, g * n), max(1, g * n // 8), 1),
            group_size=g,
            sampling=self.settings,
            score=score,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            seed=SEED,
            reward_names=("exact_match",),
        )

    def _strategy(self) -> Any:
        from zerofit.config import load_config
        from zerofit.engine_spec import render_spec
        from zerofit.resolution import resolve
        from zerofit.strategies.env import LaunchEnv
        from zerofit.strategies.single import SingleStrategy

        overrides = ["distributed.strategy=single", "train.precision=fp32", f"data.path={PROMPTS}"]
        cfg = load_config(None, [*overrides, "batch.global_batch_size=1", "batch.micro_batch_size=1"])
        strategy = SingleStrategy(LaunchEnv(0, 1, 0, False), render_spec(resolve(cfg, 1)))
        strategy.prepare(
            self.model,
            lambda m: torch.optim.Adam(m.parameters(), lr=1e-6),
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        )
        return strategy


def exact_match_scorer() -> Any:
    """zerofit's `exact_match` on the `answer` column as a rollout scorer."""
    from zerofit.objectives.grpo.rewards import exact_match

    score = exact_match("answer")

    def scorer(
        prompts: list[str], texts: list[str], columns: dict[str, list[Any]], step: int, rows: list[int]
    ):
        del step, rows
        values = torch.tensor(score(prompts, texts, columns), dtype=torch.float64)
        return values, {"exact_match": values}

    return scorer


class Trl:
    """TRL's side: a `GRPOTrainer` on the same model, prompts and settings (`trl_grpo_baseline.py`'s reward)."""

    def __init__(self, make: Callable[[], torch.nn.Module], tokenizer: Any, args: argparse.Namespace) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from trl_grpo_baseline import _reward

        self.args, self.rows = args, prompt_rows(args.prompts, args.chat)
        self.times: list[tuple[float, int]] = []
        g, n = args.g, len(self.rows)
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="rollout-vs-trl-"),
            per_device_train_batch_size=min(8, g * n),
            gradient_accumulation_steps=max(1, g * n // 8),
            num_generations=g,
            max_completion_length=args.tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            learning_rate=1e-6,
            max_steps=1,
            gradient_checkpointing=False,
            bf16=False,  # TRL's GRPOConfig defaults to bf16 autocast; zerofit's side is fp32 too
            use_cpu=True,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=SEED,
        )
        model = make()
        model.generation_config.eos_token_id = list(eos_ids(tokenizer, model))
        self.trainer = GRPOTrainer(
            model=model,
            reward_funcs=[_reward()],
            args=config,
            train_dataset=Dataset.from_list(self.rows * 64),
            processing_class=tokenizer,
            callbacks=[self._timer()],
        )

    def generate(self, repeat: int) -> int:
        """One step's completions through `GRPOTrainer._generate` (its HF-generate path): the tokens sampled."""
        del repeat
        prompts = [r["prompt"] for r in self.rows for _ in range(self.args.g)]
        with torch.no_grad():
            completion_ids = self.trainer._generate(prompts)[1]
        return sum(len(c) for c in completion_ids)

    def step(self) -> tuple[float, int]:
        """One `GRPOTrainer.train` optimizer step: its CPU seconds and completion tokens (its log's mean
        length x the completions)."""
        self.times.clear()
        self.trainer.train()
        seconds = self.times[-1][0]
        mean = [
            h["completions/mean_length"]
            for h in self.trainer.state.log_history
            if "completions/mean_length" in h
        ]
        return seconds, round(mean[-1] * self.args.g * len(self.rows))

    def _timer(self) -> Any:
        from transformers import TrainerCallback

        times = self.times

        class StepTimer(TrainerCallback):  # type: ignore[misc]
            """CPU seconds of every optimizer step (generation and update are both in it)."""

            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.start = time.process_time()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                times.append((time.process_time() - self.start, state.global_step))

        return StepTimer()


class ForwardClock:
    """CPU seconds spent inside a model's `forward` (the outermost call only), kept per segment: the share
    of a side's CPU that is the model's own work. The wrapper keeps `forward`'s signature (`functools.wraps`),
    which transformers' `generate` inspects (e.g. for `logits_to_keep`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds, self.depth = 0.0, 0
        inner = model.forward

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.process_time() - start

        model.forward = timed  # type: ignore[method-assign]

    def lap(self) -> float:
        """The seconds since the last lap."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def cpu_seconds(fn: Callable[[], int]) -> tuple[float, int]:
    """`fn()`'s CPU seconds and what it returned (tokens)."""
    start = time.process_time()
    tokens = fn()
    return time.process_time() - start, tokens


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model's alternating segments: tokens per CPU-second of generation and of whole steps, each side."""
    make, tokenizer = load(name)
    zf, trl = Zerofit(make, tokenizer, args), Trl(make, tokenizer, args)
    clocks = {"zf": ForwardClock(zf.model), "trl": ForwardClock(trl.trainer.model)}
    # warm-up: first-call allocations, lazy imports and the trainer's first-step set-up on neither side
    zf.generate(-1), trl.generate(-1), zf.step(), trl.step()
    rates: dict[str, list[float]] = {k: [] for k in ("zf_gen", "trl_gen", "zf_step", "trl_step")}
    forward: dict[str, list[float]] = {"zf": [], "trl": []}  # generation's share of CPU in the forward
    for repeat in range(args.repeats):
        order = (("zf", zf), ("trl", trl)) if repeat % 2 == 0 else (("trl", trl), ("zf", zf))
        for side, runner in order:
            clocks[side].lap()
            seconds, tokens = cpu_seconds(lambda r=runner, k=repeat: r.generate(k))
            rates[f"{side}_gen"].append(tokens / seconds)
            forward[side].append(clocks[side].lap() / seconds)
        for side, runner in order:
            seconds, tokens = runner.step() if side == "trl" else cpu_seconds(zf.step)
            rates[f"{side}_step"].append(tokens / seconds)
    return {**summary(name, rates), **ceiling(rates, forward)}


def ceiling(rates: dict[str, list[float]], forward: dict[str, list[float]]) -> dict[str, Any]:
    """Each side's generation CPU in the model's forward (median share) and the ceilings it sets: zerofit's
    tokens per forward-CPU-second over TRL's tokens per CPU-second (nothing outside zerofit's forward), and
    TRL's tokens per forward-CPU-second over its tokens per CPU-second (the same forward cost per token on
    both sides, nothing else on zerofit's)."""
    share = {side: statistics.median(v) for side, v in forward.items()}
    zf = statistics.median(r / f for r, f in zip(rates["zf_gen"], forward["zf"], strict=True))
    trl_rate = statistics.median(rates["trl_gen"])
    return {
        "forward_share_gen": {side: round(v, 3) for side, v in share.items()},
        "ceiling_gen": round(zf / trl_rate, 3),
        "ceiling_gen_same_forward": round(1 / share["trl"], 3),
    }


def summary(name: str, rates: dict[str, list[float]]) -> dict[str, Any]:
    """Medians, the ratios of the medians and the medians of the paired ratios."""
    median = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    out: dict[str, Any] = {
        "model": name,
        "tokens_per_cpu_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
    }
    out["median_tokens_per_cpu_s"] = median
    for what in ("gen", "step"):
        zf, trl = rates[f"zf_{what}"], rates[f"trl_{what}"]
        out[f"ratio_{what}"] = round(median[f"zf_{what}"] / median[f"trl_{what}"], 3)
        out[f"paired_ratio_{what}"] = round(statistics.median(a / b for a, b in zip(zf, trl, strict=True)), 3)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated built-in models")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--g", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--tokens", type=int, default=32, help="max completion tokens")
    parser.add_argument("--repeats", type=int, default=3, help="alternating segments per side")
    parser.add_argument("--chat", action="store_true", help="prompts as chat messages (the chat template)")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, 4 tokens, one repeat")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.tokens, args.repeats = "tiny-llama", 4, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args, load_at_start = parse(argv), list(os.getloadavg())
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread each: zerofit's engine keeps it (`limit_cpu_threads`)
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    results = []
    for name in args.models.split(","):
        result = measure(name, args)
        results.append(result)
        print(
            f"{name}: G {args.g} x {args.prompts} {'chat ' if args.chat else ''}prompts, <= {args.tokens} tokens, "
            "one thread; completion tokens "
            f"per CPU-second (median): zerofit {result['median_tokens_per_cpu_s']['zf_gen']} vs TRL "
            f"{result['median_tokens_per_cpu_s']['trl_gen']}\n"
            f"  zerofit / TRL generation: {result['ratio_gen']}x (paired median {result['paired_ratio_gen']}x)\n"
            f"  zerofit / TRL whole step: {result['ratio_step']}x (paired median {result['paired_ratio_step']}x)\n"
            f"  generation CPU in the model's forward: zerofit {result['forward_share_gen']['zf']:.0%}, TRL "
            f"{result['forward_share_gen']['trl']:.0%}; ceiling (nothing outside zerofit's forward): "
            f"{result['ceiling_gen']}x, {result['ceiling_gen_same_forward']}x with TRL's forward cost per token",
            flush=True,
        )
    if args.json is not None:
        from workloads import report_header

        versions = {
            "trl": __import__("trl").__version__,
            "transformers": __import__("transformers").__version__,
        }
        report = {
            **report_header("rollout_vs_trl.py", argv, load_at_start, threads=1, **versions),
            "settings": {k: getattr(args, k) for k in ("prompts", "g", "tokens", "repeats", "chat", "smoke")},
            "results": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
