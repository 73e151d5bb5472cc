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
tool, calls and errors per trajectory, turns (and an environment's own reward, when there is one).

`--warmup N`: SFT before RL, as practitioners do when the base never calls the tool. N steps of SFT (LoRA,
the same modules, `WARMUP`) on `WARMUP_ROWS` solved conversations (their own seed: neither GRPO's problems
nor the held-out ones), rendered as the rollouts are (the fallback's system turn, a calculator call, its
`<tool_response>`, the number), exported merged; GRPO then starts from that model. Reported as three
columns sampled the same way: the base (no training), the warm-up (GRPO's adapters off) and GRPO.
`--warmup-from DIR`: GRPO from an earlier warm-up's merged model (`warm` in that run's `--runs` folder).
`--base-only`: the base's score alone, no training (is there any call for GRPO to reinforce?).

`--toy tools`: the same benchmark on the built-in tiny model taught the call format
(`tests/agent_helpers.py`: its model, its two tools and `a*b?` problems with `a` in the row's table), full
fine-tune (`TOY`). `--toy env`: the demo's toy environment (`configs/demo-agent.yaml`: tiny-llama,
`DigitsTwice`, no tools), held out: the sums `data/demo_grpo.jsonl` does not hold; its reward is the
environment's. Both are CPU-cheap (minutes).

    python benchmarks/agent_real.py                               # ~15 CPU-minutes on 2 shared cores
    python benchmarks/agent_real.py --warmup 8 --heldout 12 --samples 1 train.max_steps=4
    python benchmarks/agent_real.py --json benchmarks/results/agent_real-<date>.json
    python benchmarks/agent_real.py --toy env --samples 4         # the tiny model's toy environment
    python benchmarks/agent_real.py --smoke                       # tiny-llama, 1 step: checks the script
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import add_run_arguments, run_benchmark, train_then_score

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo-grpo.yaml"
ENV_CONFIG = REPO / "configs" / "demo-agent.yaml"  # --toy env
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
# --warmup N: N steps of SFT (LoRA, the same modules) on WARMUP_ROWS solved conversations before GRPO, whose
# run then starts from the merged warm-up model.
WARMUP_ROWS = 16
WARMUP = (
    "model.name_or_path=smollm2-135m-instruct",
    "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    "distributed.strategy=single",
    "distributed.preset=null",
    "train.precision=fp32",
    "optimizer.lr=1.0e-3",
    "scheduler.name=constant",
    "scheduler.warmup_steps=0",
    "batch.global_batch_size=4",
    "batch.micro_batch_size=4",
    "data.format=messages",
    "data.max_seq_len=576",
    "logging.wandb.mode=disabled",
    "logging.console=false",
)
# --toy: the built-in tiny model taught the call format (`tests/agent_helpers.py`), full fine-tune, its
# two tools (calculator, lookup in the row's `facts`) and up to 3 turns.
TOY = (
    "lora.enabled=false",
    "optimizer.lr=1.0e-3",
    "scheduler.name=constant",
    "scheduler.warmup_steps=0",
    "train.max_steps=20",
    "batch.micro_batch_size=8",
    "rl.max_prompt_length=64",
    "rl.max_completion_length=256",  # three turns: lookup, calculator, answer (~70 tokens a call)
    "rl.max_turns=3",
    "data.max_seq_len=320",
)
SMOKE = (
    "model.name_or_path=tiny-llama",
    "train.max_steps=1",
    "rl.max_prompt_length=1024",
    "data.max_seq_len=1088",
)


def problems(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows `What is A * B?` (A three digits, B two) with the exact product as `answer` and the
    calculator's `expression` (the warm-up's demonstrations call it)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        question = f"What is {a} * {b}? Use the calculator, then answer with the number only."
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "answer": str(a * b),
                "expression": f"{a} * {b}",
            }
        )
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

    agent = build_agent(rl, tokenizer, eos, decode, prompts, seed)
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
    env = [float(t["env_reward"]) for t in trajectories] if rl.environment else []
    return {
        **({"reward": round(sum(env) / len(env), 4)} if env else {}),  # an environment's own reward
        "accuracy": round(sum(correct) / len(correct), 4),
        "tool_call_rate": round(float((field["tool_calls"] > 0).double().mean()), 4),
        "tool_calls_per_trajectory": round(float(field["tool_calls"].mean()), 4),
        "tool_errors_per_trajectory": round(float(errors.mean()), 4),
        "turns_per_trajectory": round(float(field["turns"].mean()), 4),
        "trajectories": len(texts),
        "examples": [t["messages"][-3:] for t in trajectories[:2]],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line: the task, held-out problems and samples, results file, config overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_run_arguments(parser, samples=2, smoke="tiny-llama, 1 step, 3 held-out problems")
    parser.add_argument("--heldout", type=int, default=HELDOUT, help="held-out problems")
    parser.add_argument(
        "--toy", choices=("tools", "env"), default=None, help="a tiny model's toy task instead (see above)"
    )
    parser.add_argument("--base-only", action="store_true", help="score the base model only (no training)")
    parser.add_argument("--warmup", type=int, default=0, help="SFT warm-up steps before GRPO (0: none)")
    parser.add_argument(
        "--warmup-from", type=Path, default=None, help="an earlier --warmup's merged model (runs/warm)"
    )
    return parser.parse_args(argv)


def task(
    args: argparse.Namespace,
) -> tuple[Path, list[str], list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The run's config, overrides, training rows (None: the config's own data) and held-out rows: SmolLM2's
    task; `--toy tools`, the tiny model taught the call format (`tests/agent_helpers.py`: its model, tools
    and problems, held-out drawn with another seed); `--toy env`, the demo's toy environment
    (`configs/demo-agent.yaml`, DigitsTwice) on the sums its data file does not hold."""
    n = 3 if args.smoke else args.heldout
    once = ("train.max_steps=1",) if args.smoke else ()
    if args.toy == "env":
        from grpo_real import heldout_rows

        data = REPO / "data" / "demo_grpo.jsonl"
        return ENV_CONFIG, [f"data.path={data}", "logging.console=false", *once], None, heldout_rows(data)[:n]
    if not args.toy:
        return CONFIG, [*REAL, *(SMOKE if args.smoke else ())], problems(TRAIN, seed=1), problems(n, seed=2)
    sys.path.insert(0, str(REPO / "tests"))
    import agent_helpers

    toy = [f"model.name_or_path={agent_helpers.tool_caller()}", f"rl.tools={json.dumps(agent_helpers.TOOLS)}"]
    held = agent_helpers.problems(n, seed=2)
    return CONFIG, [*REAL, *TOY, *toy, *once], agent_helpers.problems(TRAIN, seed=1), held


def demonstrations(rows: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The warm-up's SFT rows: each problem solved as the rollouts render it through the fallback (its system
    turn, the question, a calculator call, the tool's reply as a user turn, the number)."""
    from zerofit.objectives.grpo.tool_calls import fallback_system_text, hermes_call, tool_reply

    system = {"role": "system", "content": fallback_system_text(schemas)}
    out = []
    for row in rows:
        call = hermes_call("calculator", {"expression": row["expression"]})
        reply = tool_reply("calculator", row["answer"], native=False, index=0)
        turns = [
            {"role": "assistant", "content": call},
            reply,
            {"role": "assistant", "content": row["answer"]},
        ]
        out.append({"messages": [system, *row["prompt"], *turns]})
    return out


def warm_up(args: argparse.Namespace, runs: Path, schemas: list[dict[str, Any]]) -> tuple[Path, float]:
    """`--warmup` steps of SFT on the demonstrations through `zerofit.train`, exported merged: the folder
    GRPO starts from, and the warm-up's wall time."""
    import zerofit
    from zerofit.config import load_config
    from zerofit.export.folder import export_run

    rows_file = runs / "warmup.jsonl"
    rows = demonstrations(problems(WARMUP_ROWS, seed=3), schemas)
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    where = [
        f"output_dir={runs}",
        "run_name=warmup",
        f"data.path={rows_file}",
        f"train.max_steps={args.warmup}",
    ]
    started = time.perf_counter()
    result = zerofit.train(load_config(REPO / "configs" / "demo.yaml", [*WARMUP, *where]))
    export_run(result.run_dir, runs / "warm", merge=True)
    return runs / "warm", time.perf_counter() - started


def train_and_score(args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """Train through `zerofit.train`, then score the base and the trained model (`--base-only`: the base's
    score alone, no training)."""
    import torch

    from zerofit.config import load_config
    from zerofit.models.build import load_tokenizer
    from zerofit.trained.model import load_base

    config, overrides, train_rows, held = task(args)
    train_file, rows_file = runs / "train.jsonl", runs / "heldout.jsonl"
    where = [f"output_dir={runs}", "run_name=agent-real"]
    if train_rows is not None:
        train_file.write_text("".join(json.dumps(r) + "\n" for r in train_rows))
        where.append(f"data.path={train_file}")
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in held))
    cfg = load_config(config, [*overrides, *where, *args.overrides])

    def score(model: Any, tokenizer: Any) -> dict[str, Any]:
        return heldout_score(model, tokenizer, cfg, rows_file, args.samples, args.seed)

    if args.base_only:
        base = score(load_base(cfg, torch.float32, "cpu").eval(), load_tokenizer(cfg))
        out: dict[str, Any] = {"train_s": 0.0, "base": base, "trained": base, "metrics": []}
    elif args.warmup or args.warmup_from:
        from zerofit.recipe.tools import build_tools

        warm, warm_s = (
            (args.warmup_from, 0.0) if args.warmup_from else warm_up(args, runs, build_tools(cfg.rl.tools)[0])
        )
        base = score(load_base(cfg, torch.float32, "cpu").eval(), load_tokenizer(cfg))  # before any training
        print(f"base: {json.dumps(base)}", flush=True)  # a long run's first number, printed at once
        cfg = load_config(CONFIG, [*overrides, *where, *args.overrides, f"model.name_or_path={warm}"])
        out = train_then_score(cfg, score)  # its base: the warm-up (GRPO's adapters off)
        out = {**out, "base": base, "warmup": out["base"], "warmup_s": warm_s}
    else:
        out = train_then_score(cfg, score)
    keys = ("reward", "agent/tool_calls", "agent/tool_errors", "agent/turns")
    curve = [{k: round(float(r[k]), 4) for k in keys} for r in out["metrics"] if "reward" in r]
    return {**out, "cfg": cfg, "overrides": overrides, "curve": curve}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    def report(out: dict[str, Any]) -> dict[str, Any]:
        cfg = out["cfg"]
        return {
            "run": {
                "task": f"toy-{args.toy}" if args.toy else "real",
                "overrides": [*out["overrides"], *args.overrides],
                "model": cfg.model.name_or_path,
                "steps": 0 if args.base_only else cfg.train.max_steps,
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
            **(
                {"warmup": out["warmup"], "warmup_wall_s": round(out["warmup_s"], 1)}
                if "warmup" in out
                else {}
            ),
            "trained": out["trained"],
            "train_per_step": out["curve"],
        }

    return run_benchmark(
        "agent_real.py", argv, args, lambda runs: train_and_score(args, runs), report, print_report
    )


def print_report(report: dict[str, Any]) -> None:
    """The run, then the held-out accuracy and tool use of the base and the trained model."""
    run = report["run"]
    print(
        f"{run['model']}: agentic GRPO ({run['task']}), {run['steps']} steps of {run['prompts_per_step']} "
        f"prompts x G {run['num_generations']}, <= {run['max_turns']} turns / {run['max_completion_length']} "
        f"tokens, lr {run['lr']}, {run['train_wall_s']} s"
    )
    for name in ("base", "warmup", "trained"):
        if name not in report:
            continue
        s = report[name]
        reward = f"reward {s['reward']:.3f}  " if "reward" in s else ""
        print(
            f"  {name:8s} {reward}held-out accuracy {s['accuracy']:.3f}  tool-call rate {s['tool_call_rate']:.3f}  "
            f"calls {s['tool_calls_per_trajectory']:.2f}  errors {s['tool_errors_per_trajectory']:.2f}  "
            f"turns {s['turns_per_trajectory']:.2f}  ({s['trajectories']} trajectories)"
        )
    print(f"  train per step: {report['train_per_step']}")


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"[{time.perf_counter() - started:.0f} s]")
    sys.exit(code)
