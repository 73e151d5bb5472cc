"""zerofit against HF Trainer + peft on the CPU, at the same memory budget and the same global batch.

The GPU is lent only sometimes; this is the evidence that needs none. In one process, on a built-in model
(`--model`: the random-init tiny-llama, or the real SmolLM2-135M-Instruct, `smollm2-135m-instruct`, whose
49,152-entry vocabulary makes the head's cost real; LoRA r16 on all linear layers, fp32), on the same examples
(`workloads.py`: max-length and real-length) and the same global batch:

  hf           HF Trainer + peft (`hf_baseline.train_hf`): micro-batches of --hf-micro examples padded to
               their longest, every decoder layer checkpointed (the shipped 3090 recipe's setting).
  zf-same      zerofit with HF's plan: the same micro-batch, every layer checkpointed, unchunked loss
               (what zerofit's loop itself costs or saves).
  zf-full      zerofit, the planner's micro-batch but every layer checkpointed (isolates the next line).
  zf-auto      zerofit with `batch.micro_batch_size=auto train.activation_checkpointing=auto`, chunked loss:
               the planner's fastest plan under the budget.
  zf-packed    zf-auto with `batch.tokens_per_micro_batch=auto` (packed rows) instead of a micro-batch.

The memory budget is a planned cap: the planner's predicted total for HF's plan (same model, micro-batch,
checkpointing, unchunked loss) is the budget every zerofit plan must fit (`planner.gpu_memory_gib`, with
the usual 5% headroom); the results file records each plan's predicted total. On the CPU the process RSS
is dominated by the libraries, so the planned cap is the comparable budget. Selective checkpointing has
to show its win here as well: recomputation is FLOPs on a CPU too.

Cases alternate over --repeats rounds (machine noise falls on all); each runs --steps timed optimizer
steps after one warm-up step, on --threads CPU threads (default 1). Reported: medians of label, useful
(non-pad) and processed tokens per wall second, useful tokens per second of this process's CPU time, and
the ratios zerofit / HF. The ratios are taken on CPU time: on a CPU shared with other work, wall time
swings several-fold between identical runs, while one thread's CPU time measures the work each trainer
does. A measurement, not a test.

    python benchmarks/cpu_vs_hf.py                                # seq 256, global 16, HF micro 4
    python benchmarks/cpu_vs_hf.py --steps 4 --repeats 3 --json benchmarks/results/cpu_vs_hf-<date>.json
    python benchmarks/cpu_vs_hf.py --model smollm2-135m-instruct --seq 128 --global-batch 8 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_baseline import train_hf
from workloads import describe, report_header, run_zerofit, workload

REPO = Path(__file__).resolve().parents[1]
# The built-in models it runs on: the random-init tiny-llama (vocabulary 128: the head costs nothing) and the
# real SmolLM2-135M-Instruct (vocabulary 49,152: the head's matmuls and logits are a real share of the step).
MODELS = ("tiny-llama", "smollm2-135m-instruct")


def _overrides(args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        f"model.name_or_path={args.model}",
        "distributed.strategy=single",
        "distributed.preset=null",
        "train.precision=fp32",
        f"data.max_seq_len={args.seq}",
        f"data.path={REPO / 'data' / 'demo.jsonl'}",
        f"batch.global_batch_size={args.global_batch}",
        "lora.dropout=0.05",
        "lora.target_modules=all-linear",
        "optimizer.lr=2e-4",
        "logging.wandb.mode=disabled",
        "logging.console=false",
        f"seed={args.seed}",
        *extra,
    ]


def planned_cap(args: argparse.Namespace) -> tuple[float, float]:
    """(budget GiB, HF plan's predicted total GiB): HF's plan exactly fills the budget's 95%."""
    from zerofit.config import load_config
    from zerofit.planner.estimate import estimate
    from zerofit.planner.scenario import what_if

    cfg = load_config(
        None,
        _overrides(
            args,
            f"batch.micro_batch_size={args.hf_micro}",
            "train.activation_checkpointing=true",
            "train.cross_entropy=unchunked",
        ),
    )
    total = estimate(what_if(cfg, 1)).total_gib
    return total / 0.95, total


def resolved_case(args: argparse.Namespace, cap: float, *extra: str) -> Any:
    from zerofit.config import load_config
    from zerofit.planner import choose_fastest_plan
    from zerofit.resolution import resolve

    cfg = load_config(None, _overrides(args, f"planner.gpu_memory_gib={cap}", *extra))
    return resolve(cfg, 1, choose_fastest_plan)


def predicted_total(resolved: Any) -> float:
    from zerofit.engine_spec import render_spec
    from zerofit.planner.estimate import estimate
    from zerofit.planner.scenario import scenario_for

    return round(estimate(scenario_for(resolved.config, render_spec(resolved))).total_gib, 5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="a built-in model (see MODELS)")
    parser.add_argument("--seq", type=int, default=256, help="data.max_seq_len (tiny-llama allows 512)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--hf-micro", type=int, default=4, help="HF's per_device_train_batch_size")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per case and round")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; cases alternate within each")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU time is per process)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    load_at_start = [round(x, 2) for x in os.getloadavg()]  # a shared CPU: how loaded it was
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # zerofit's strategy keeps a user's thread count
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from zerofit.config import load_config
    from zerofit.core.messages import quiet_libraries
    from zerofit.models.build import resolve_model_path

    quiet_libraries()
    model_dir = resolve_model_path(load_config(None, _overrides(args)))
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)  # the token ids span the real vocabulary
    n = args.global_batch * (args.steps + 1)
    data = {
        name: workload(name, n, args.seq, vocab, seed=args.seed) for name in ("max_length", "real_length")
    }
    cap, hf_total = planned_cap(args)
    hf_gas = args.global_batch // args.hf_micro
    auto = resolved_case(args, cap, "batch.micro_batch_size=auto", "train.activation_checkpointing=auto")
    cases: dict[str, tuple[str, Any]] = {
        "zf-same": (
            "max_length",
            resolved_case(
                args, cap, f"batch.micro_batch_size={args.hf_micro}", "train.activation_checkpointing=true",
                "train.cross_entropy=unchunked",
            ),
        ),
        "zf-full": (
            "max_length",
            resolved_case(args, cap, f"batch.micro_batch_size={auto.batch.micro_batch_size}",
                          "train.activation_checkpointing=true"),
        ),
        "zf-auto": ("max_length", auto),
        "zf-packed": (
            "real_length",
            resolved_case(args, cap, "batch.tokens_per_micro_batch=auto", "train.activation_checkpointing=auto"),
        ),
        "zf-auto-real": ("real_length", auto),
    }  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*cases, "hf", "hf-real"]}
    torch.manual_seed(args.seed)
    for _ in range(args.repeats):
        for name, (load, resolved) in cases.items():
            runs[name].append(run_zerofit(resolved, data[load], args.steps))
        for name, load in (("hf", "max_length"), ("hf-real", "real_length")):
            runs[name].append(
                train_hf(
                    model_dir, data[load], micro=args.hf_micro, gas=hf_gas, steps=args.steps, precision="fp32",
                    seed=args.seed,
                )
            )  # fmt: skip

    def median(name: str, field: str) -> float:
        return round(statistics.median(r[field] for r in runs[name]), 4)

    summary = {
        name: {
            field: median(name, field)
            for field in (
                "tokens_per_s",
                "useful_tokens_per_s",
                "processed_tokens_per_s",
                "step_time_s",
                "useful_tokens_per_cpu_s",
                "cpu_s_per_step",
            )
        }
        for name in runs
    }
    for name, (_, resolved) in cases.items():
        summary[name].update(split=runs[name][0]["split"], predicted_total_gib=predicted_total(resolved))
    for name in ("hf", "hf-real"):
        summary[name].update(split={"micro_batch_size": args.hf_micro, "grad_accum_steps": hf_gas})

    def r(a: str, b: str) -> float:
        return median(a, "useful_tokens_per_cpu_s") / median(b, "useful_tokens_per_cpu_s")

    ratio = {
        "zf-same / hf (max-length, HF's plan)": r("zf-same", "hf"),
        "zf-auto / hf (max-length)": r("zf-auto", "hf"),
        "zf-auto / zf-full (selective checkpointing, same micro-batch)": r("zf-auto", "zf-full"),
        "zf-auto-real / hf-real (real-length, padded)": r("zf-auto-real", "hf-real"),
        "zf-packed / hf-real (real-length, packed)": r("zf-packed", "hf-real"),
    }
    report = {
        **report_header("cpu_vs_hf.py", argv, load_at_start),
        "settings": vars(args) | {"json": str(args.json) if args.json else None},
        "budget": {"planned_cap_gib": round(cap, 5), "hf_plan_predicted_total_gib": round(hf_total, 5)},
        "workloads": {name: describe(examples) for name, examples in data.items()},
        "median": summary,
        "ratios_useful_tokens_per_cpu_s": {k: round(v, 3) for k, v in ratio.items()},
        "runs": runs,
    }
    print(f"budget: {cap:.4f} GiB planned cap (HF's plan predicted {hf_total:.4f} GiB = 95% of it)")
    for name, s in summary.items():
        split = s.get("split", {})
        print(
            f"  {name:13s} useful {s['useful_tokens_per_cpu_s']:9,.1f} tok/cpu-s ({s['useful_tokens_per_s']:9,.1f} "
            f"tok/wall-s, processed {s['processed_tokens_per_s']:9,.1f}, labels {s['tokens_per_s']:9,.1f})  "
            f"cpu {s['cpu_s_per_step']:.3f} s/step  {split}"
        )
    for k, v in ratio.items():
        print(f"  {k}: {v:.2f}x (useful tokens per CPU second)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"[{time.perf_counter() - started:.0f} s]")
    sys.exit(code)
