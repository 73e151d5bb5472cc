"""Agentic GRPO on the real pretrained model: SmolLM2-135M-Instruct with the calculator tool on multi-digit
arithmetic, held-out accuracy and tool-call rate before and after a short LoRA run, on CPU.

The task: `What is A * B?` with A of three digits and B of two, which a 135M model cannot multiply in its
head; the built-in `calculator` tool (`rl.tools`) is offered, and the reward is `exact_match` of the last
assistant turn against the `answer` column. SmolLM2's chat template has no tools section, so the rollouts
use zerofit's documented fallback: the tool's schema in a system turn, Hermes `<tool_call>` calls, replies as
`<tool_response>` user turns (docs/guides/agents.md). The run goes through zerofit's own API (`zerofit.train`,
one process) with `REAL` below plus any `key=value` overrides.

Held-out: `HELDOUT` problems drawn with another seed (none in the training file). Each gets `--samples`
trajectories sampled by zerofit's own turn loop (`zerofit.loop.turns.sample_trajectories`, the run's
temperature and tools) with fixed seeds, the same for the base (the trained model with its LoRA adapters
disabled) and the trained model; reported: accuracy (exact_match), the share of trajectories that called a
tool, calls and errors per trajectory, turns.

    python benchmarks/agent_real.py                               # ~15 CPU-minutes on 2 shared cores
    python benchmarks/agent_real.py --json benchmarks/results/agent_real-<date>.json
    python benchmarks/agent_real.py --smoke                       # tiny-llama, 1 step: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import report_header

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo-grpo.yaml"
TRAIN, HELDOUT = 64, 24  # problems
REAL = (
    "model.name_or_path=smollm2-135m-instruct",
    "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    "optimizer.lr=5.0e-4",
    "train.max_steps=10",
    "batch.global_batch_size=null",
    "batch.micro_batch_size=4",
    "rl.num_generations=4",
    "rl.prompts_per_step=2",
    "rl.max_prompt_length=512",
    "rl.max_completion_length=64",
    "rl.max_turns=2",
    "rl.tools=[{function: calculator}]",
    "rl.rewards=[{function: exact_match, column: answer}]",
    "data.max_seq_len=576",
    "logging.wandb.mode=disabled",
    "logging.console=false",
)
SMOKE = (
    "model.name_or_path=tiny-llama",
    "train.max_steps=1",
    "rl.max_prompt_length=1024",
    "data.max_seq_len=1088",
)


def problems(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows `What is A * B?` (A three digits, B two) with the exact product as `answer`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        question = f"What is {a} * {b}? Use the calculator, then answer with the number only."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a * b)})
    return rows


def heldout_score(model: Any, tokenizer: Any, cfg: Any, rows_file: Path, samples: int, seed: int) -> dict:
    """Accuracy and tool use of `samples` fixed-seed trajectories per held-out problem."""
    import torch

    from zerofit.data.prompts import load_prompts
    from zerofit.loop.rollout import SamplingSettings, sample_completions
    from zerofit.loop.turns import AGENT_FIELDS, sample_trajectories
    from zerofit.objectives.grpo.rewards import exact_match
    from zerofit.recipe.rl import end_ids
    from zerofit.recipe.tools import build_agent

    rl, cpu = cfg.rl, torch.device("cpu")
    prompts = load_prompts(rows_file, tokenizer, rl.max_prompt_length).prompts
    eos = end_ids(tokenizer, model.config)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    agent = build_agent(rl, tokenizer, eos, decode, prompts)
    assert agent is not None
    flat = [p for p in prompts for _ in range(samples)]
    settings = SamplingSettings(rl.max_completion_length, eos, int(tokenizer.pad_token_id), rl.temperature)

    def sample(ps: list[list[int]], seeds: list[int], s: SamplingSettings, shown: Any) -> list[Any]:
        return sample_completions(model, ps, seeds, s, cpu, shown)

    trajectories = sample_trajectories(agent, sample, flat, list(range(len(flat))), seed, 0, settings)
    texts = [t["text"] for t in trajectories]
    correct = exact_match("answer")(
        [p.text for p in flat], texts, {"answer": [p.columns["answer"] for p in flat]}
    )
    stats = torch.stack([t["stats"] for t in trajectories])
    field = {name: stats[:, k] for k, name in enumerate(AGENT_FIELDS)}
    errors = sum(v for k, v in field.items() if k.startswith("tool_errors/"))
    return {
        "accuracy": round(sum(correct) / len(correct), 4),
        "tool_call_rate": round(float((field["tool_calls"] > 0).double().mean()), 4),
        "tool_calls_per_trajectory": round(float(field["tool_calls"].mean()), 4),
        "tool_errors_per_trajectory": round(float(errors.mean()), 4),
        "turns_per_trajectory": round(float(field["turns"].mean()), 4),
        "trajectories": len(texts),
        "examples": [t["messages"][-3:] for t in trajectories[:2]],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line: held-out samples, results file, config overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=2, help="sampled trajectories per held-out problem")
    parser.add_argument("--heldout", type=int, default=HELDOUT, help="held-out problems")
    parser.add_argument("--seed", type=int, default=1234, help="the held-out decode's sampling seed")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, 1 step, 3 held-out problems")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--runs", type=Path, default=None, help="where the run folder goes (default: a temp)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return parser.parse_args(argv)


def train_and_score(args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """Train through `zerofit.train`, then score the base (adapters off) and the trained model."""
    import zerofit
    from zerofit.config import load_config
    from zerofit.trained.model import load_trained

    train_file, rows_file = runs / "train.jsonl", runs / "heldout.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in problems(TRAIN, seed=1)))
    held = problems(3 if args.smoke else args.heldout, seed=2)
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in held))
    overrides = [*REAL, *(SMOKE if args.smoke else ())]
    where = [f"output_dir={runs}", "run_name=agent-real", f"data.path={train_file}"]
    cfg = load_config(CONFIG, [*overrides, *where, *args.overrides])
    started = time.perf_counter()
    result = zerofit.train(cfg)
    train_s = time.perf_counter() - started
    trained = load_trained(result.run_dir)

    def score() -> dict[str, Any]:
        return heldout_score(trained.model, trained.tokenizer, cfg, rows_file, args.samples, args.seed)

    with trained.model.disable_adapter():  # the base: the reference GRPO uses
        base = score()
    after = score()
    keys = ("reward", "agent/tool_calls", "agent/tool_errors", "agent/turns")
    curve = [{k: round(float(r[k]), 4) for k in keys} for r in result.metrics if "reward" in r]
    return {
        "cfg": cfg,
        "overrides": overrides,
        "train_s": train_s,
        "base": base,
        "trained": after,
        "curve": curve,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from zerofit.core.messages import quiet_libraries

    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or Path(tmp)
        runs.mkdir(parents=True, exist_ok=True)
        out = train_and_score(args, runs)
    cfg = out["cfg"]
    report = {
        **report_header("agent_real.py", argv, load_at_start, threads=args.threads),
        "run": {
            "overrides": [*out["overrides"], *args.overrides],
            "model": cfg.model.name_or_path,
            "steps": cfg.train.max_steps,
            "prompts_per_step": cfg.rl.prompts_per_step,
            "num_generations": cfg.rl.num_generations,
            "max_turns": cfg.rl.max_turns,
            "max_completion_length": cfg.rl.max_completion_length,
            "lr": cfg.optimizer.lr,
            "train_wall_s": round(out["train_s"], 1),
        },
        "heldout": {
            "decode": f"sampled, temperature {cfg.rl.temperature}, seed {args.seed}",
            "samples": args.samples,
        },
        "base": out["base"],
        "trained": out["trained"],
        "train_per_step": out["curve"],
    }
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def print_report(report: dict[str, Any]) -> None:
    """The run, then the held-out accuracy and tool use of the base and the trained model."""
    run = report["run"]
    print(
        f"{run['model']}: agentic GRPO + LoRA, calculator tool, {run['steps']} steps of {run['prompts_per_step']} "
        f"prompts x G {run['num_generations']}, <= {run['max_turns']} turns / {run['max_completion_length']} "
        f"tokens, lr {run['lr']}, {run['train_wall_s']} s"
    )
    for name in ("base", "trained"):
        s = report[name]
        print(
            f"  {name:8s} held-out accuracy {s['accuracy']:.3f}  tool-call rate {s['tool_call_rate']:.3f}  "
            f"calls {s['tool_calls_per_trajectory']:.2f}  errors {s['tool_errors_per_trajectory']:.2f}  "
            f"turns {s['turns_per_trajectory']:.2f}  ({s['trajectories']} trajectories)"
        )
    print(f"  train per step: {report['train_per_step']}")


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"[{time.perf_counter() - started:.0f} s]")
    sys.exit(code)
