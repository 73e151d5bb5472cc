"""zerofit's DPO on packed pairs against TRL 1.16's DPOTrainer on the CPU: useful tokens per CPU second.

The same model (`--model`: the random-init tiny-llama, or the real SmolLM2-135M-Instruct,
`smollm2-135m-instruct`), LoRA r16 / alpha 32 / no dropout on all linear layers, fp32, the reference the base
with the adapters off (TRL's with a peft model, zerofit's `adapters_off`), sigmoid DPO at beta 0.1, AdamW at a
constant learning rate, clipping at 1.0, no activation checkpointing (TRL's default checkpointing costs a
recomputation on the CPU: off is its faster setting), the same global batch of pairs per optimizer step
(`--global-batch`: one micro-batch for TRL, the whole batch padded to its longest sequence, as its collator
does), and the same pairs: ragged real-length token ids (prompt and each response log-normal, median 12% of
`--seq`, sigma 0.9, so lengths range over two orders of magnitude; eos ends each response), handed to TRL
pre-tokenized (its `prompt_ids` / `chosen_ids` / `rejected_ids` columns, its dataset preparation skipped) and
to zerofit as `PreferencePair`s of the same ids.

    trl        TRL 1.16's DPOTrainer at its best CPU setting. Its `padding_free=True` is refused for DPO in
               1.16 ("temporarily unavailable after a refactor": it warns and falls back to padding), so its
               default padding is its best.
    zf-padded  zerofit's DPO, the global batch as one micro-batch padded to its longest sequence.
    zf-packed  zerofit's DPO packed (`batch.tokens_per_micro_batch` = global batch x seq: rows of `--seq`
               tokens, each chosen and rejected sequence a segment, position ids restarting per segment; the
               varlen attention runs each segment as its own causal sequence).

Cases alternate over --repeats rounds (machine noise falls on all); each trains --steps timed optimizer steps
after one warm-up step on one CPU thread (--threads). Useful tokens are the non-pad tokens of the policy's
forward (attention mask), per second of this process's CPU time (on a shared CPU, wall time measures the
neighbours too). Printed: each case's median and the ratios zf-packed / trl (the target is 1.5x) and
zf-padded / trl. A measurement, not a test.

    python benchmarks/packed_dpo_vs_trl.py --json benchmarks/results/packed_dpo_vs_trl-<date>.json
    python benchmarks/packed_dpo_vs_trl.py --model smollm2-135m-instruct --seq 256 --global-batch 8
    python benchmarks/packed_dpo_vs_trl.py --smoke --json /tmp/packed.json     (tiny, one step: the e2e test)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
MODELS = ("tiny-llama", "smollm2-135m-instruct")
CASES = ("trl", "zf-padded", "zf-packed")
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
BETA, LR = 0.1, 1e-4


def ragged_pairs(n: int, seq: int, vocab: int, bos: int, eos: int, seed: int) -> list[dict[str, list[int]]]:
    """`n` pre-tokenized pairs (TRL's columns): a prompt and two responses, each log-normal (median 12% of
    `seq`, sigma 0.9), the prompt at most half of `seq`, each sequence at most `seq`; random token ids."""
    rng = random.Random(seed)

    def length(low: int, high: int) -> int:
        return int(min(high, max(low, round(rng.lognormvariate(math.log(0.12 * seq), 0.9)))))

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    out = []
    for _ in range(n):
        prompt = [bos, *ids(length(2, seq // 2) - 1)]
        room = seq - len(prompt)
        chosen, rejected = ([*ids(length(1, room) - 1), eos] for _ in range(2))
        out.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return out


def describe(records: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Length statistics of the pairs' sequences (prompt + response), for the results file."""
    lengths = [
        len(r["prompt_ids"]) + len(r[side]) for r in records for side in ("chosen_ids", "rejected_ids")
    ]
    return {
        "pairs": len(records),
        "sequences": len(lengths),
        "min_tokens": min(lengths),
        "median_tokens": statistics.median(lengths),
        "mean_tokens": round(statistics.fmean(lengths), 1),
        "max_tokens": max(lengths),
    }


def zerofit_pairs(records: list[dict[str, list[int]]]) -> list[Any]:
    """The same ids as zerofit's pairs: labels on the responses (the prompt masked), as TRL's completion mask."""
    from zerofit.data import IGNORE_INDEX, Example, PreferencePair

    def example(prompt: list[int], response: list[int]) -> Example:
        return Example(prompt + response, [IGNORE_INDEX] * len(prompt) + response)

    return [
        PreferencePair(example(r["prompt_ids"], r["chosen_ids"]), example(r["prompt_ids"], r["rejected_ids"]))
        for r in records
    ]


def zerofit_case(args: argparse.Namespace, packed: bool) -> Any:
    """The resolved zerofit DPO config of a case (module docstring)."""
    from zerofit.config import load_config
    from zerofit.resolution import resolve

    split = (
        ["batch.micro_batch_size=null", f"batch.tokens_per_micro_batch={args.global_batch * args.seq}"]
        if packed
        else [f"batch.micro_batch_size={args.global_batch}"]
    )
    overrides = [
        f"model.name_or_path={args.model}",
        "distributed.strategy=single",
        "distributed.preset=null",
        "train.objective=dpo",
        "train.precision=fp32",
        "train.activation_checkpointing=false",
        "train.max_grad_norm=1.0",
        f"data.max_seq_len={args.seq}",
        f"data.path={REPO / 'data' / 'demo_preference.jsonl'}",
        f"batch.global_batch_size={args.global_batch}",
        *split,
        "lora.enabled=true",
        f"lora.r={LORA['r']}",
        f"lora.alpha={LORA['alpha']}",
        f"lora.dropout={LORA['dropout']}",
        "lora.target_modules=all-linear",
        "preference.reference=adapters_off",
        f"preference.beta={BETA}",
        f"optimizer.lr={LR}",
        "scheduler.name=constant",
        "logging.wandb.mode=disabled",
        "logging.console=false",
        f"seed={args.seed}",
    ]
    return resolve(load_config(None, overrides), 1)


def train_trl(
    model_dir: Path, records: list[dict[str, list[int]]], args: argparse.Namespace
) -> dict[str, Any]:
    """TRL's DPOTrainer on `records`: steps + 1 optimizer steps, the first a warm-up; the steady steps'
    useful (attention-mask) and processed tokens of the policy's forward and this process's CPU time."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    counted = {"useful": [], "processed": []}
    marks: list[float] = []

    class Measured(DPOTrainer):  # type: ignore[misc]
        def _prepare_dataset(self, dataset: Any, *rest: Any, **kw: Any) -> Any:
            return dataset  # pre-tokenized: the token ids zerofit trains on

        def compute_loss(self, model: Any, inputs: dict[str, Any], *rest: Any, **kw: Any) -> Any:
            counted["useful"].append(int(inputs["attention_mask"].sum()))
            counted["processed"].append(int(inputs["input_ids"].numel()))
            return super().compute_loss(model, inputs, *rest, **kw)

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            marks.append(time.process_time())

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.global_batch,
            gradient_accumulation_steps=1,
            max_steps=args.steps + 1,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            beta=BETA,
            max_length=args.seq,
            gradient_checkpointing=False,
            bf16=False,
            use_cpu=True,
            logging_steps=10**6,
            save_strategy="no",
            report_to=[],
            seed=args.seed,
            dataloader_num_workers=0,
            disable_dropout=True,
        )
        peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                          target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
        trainer = Measured(model=model, args=config, train_dataset=Dataset.from_list(records),
                           processing_class=tokenizer, peft_config=peft, callbacks=[Clock()])  # fmt: skip
        trainer.train()
    steady = slice(1, args.steps + 1)
    cpu = marks[args.steps] - marks[0]
    useful = sum(counted["useful"][steady])
    return {
        "useful_tokens_per_cpu_s": round(useful / cpu, 1),
        "cpu_s_per_step": round(cpu / args.steps, 4),
        "useful_tokens_per_step": useful / args.steps,
        "processed_tokens_per_step": sum(counted["processed"][steady]) / args.steps,
    }


def train_zerofit(resolved: Any, pairs: list[Any], steps: int) -> dict[str, Any]:
    """zerofit's training loop on `pairs` (`workloads.run_zerofit`), the fields this benchmark reports."""
    from workloads import run_zerofit

    result = run_zerofit(resolved, pairs, steps)
    return {
        "useful_tokens_per_cpu_s": result["useful_tokens_per_cpu_s"],
        "cpu_s_per_step": result["cpu_s_per_step"],
        "split": result["split"],
        "losses": result["losses"],
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", choices=MODELS, default=MODELS[0])
    parser.add_argument("--seq", type=int, default=256, help="data.max_seq_len and TRL's max_length")
    parser.add_argument("--global-batch", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per case and round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the cases alternate within each")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU time is per process)")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, seq 32, batch 2, 1 step, 1 round")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.smoke:
        args.model, args.seq, args.global_batch, args.steps, args.repeats = MODELS[0], 32, 2, 1, 1
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # a shared CPU: how loaded it was
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoTokenizer

    from zerofit.core.messages import quiet_libraries
    from zerofit.models.build import resolve_model_path

    quiet_libraries()
    cases = {"zf-padded": zerofit_case(args, packed=False), "zf-packed": zerofit_case(args, packed=True)}
    model_dir = Path(resolve_model_path(cases["zf-packed"].config))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 1
    records = ragged_pairs(
        args.global_batch * (args.steps + 1), args.seq, vocab, bos, tokenizer.eos_token_id, args.seed
    )
    pairs = zerofit_pairs(records)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        runs["trl"].append(train_trl(model_dir, records, args))
        for name, resolved in cases.items():
            runs[name].append(train_zerofit(resolved, pairs, args.steps))
    report = _report(args, runs, records, load_at_start, torch.__version__)
    _print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _report(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, Any]]],
    records: list[dict[str, list[int]]],
    load_at_start: list[float],
    torch_version: str,
) -> dict[str, Any]:
    """The results file: settings, machine, workload, per-run numbers, medians and the ratios."""
    from importlib.metadata import version

    median = {
        name: {
            field: round(statistics.median(r[field] for r in runs[name]), 4)
            for field in ("useful_tokens_per_cpu_s", "cpu_s_per_step")
        }
        for name in CASES
    }

    def ratio(a: str) -> float:
        return round(median[a]["useful_tokens_per_cpu_s"] / median["trl"]["useful_tokens_per_cpu_s"], 3)

    return {
        "script": "benchmarks/packed_dpo_vs_trl.py",
        "command": "python benchmarks/packed_dpo_vs_trl.py " + " ".join(sys.argv[1:]),
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch_version,
            "trl": version("trl"),
            "transformers": version("transformers"),
            "load_average_at_start": load_at_start,
        },
        "settings": vars(args) | {"json": str(args.json) if args.json else None, "lora": LORA, "beta": BETA},
        "trl_best_setting": "padding (DPOConfig.padding_free=True falls back to padding for DPO in TRL 1.16)",
        "workload": describe(records),
        "median": median,
        "ratios_useful_tokens_per_cpu_s": {
            "zf-packed / trl": ratio("zf-packed"),
            "zf-padded / trl": ratio("zf-padded"),
        },
        "target": {"zf-packed / trl": 1.5},
        "runs": runs,
    }


def _print(report: dict[str, Any]) -> None:
    s = report["settings"]
    w = report["workload"]
    print(
        f"DPO on {s['model']}, {w['pairs']} ragged pairs (sequences {w['min_tokens']}..{w['max_tokens']} tokens, "
        f"median {w['median_tokens']}), global batch {s['global_batch']}, seq {s['seq']}, {s['threads']} thread(s)"
    )
    for name, m in report["median"].items():
        print(
            f"  {name:10s} useful {m['useful_tokens_per_cpu_s']:9,.1f} tok/cpu-s   cpu {m['cpu_s_per_step']:.3f} s/step"
        )
    for k, v in report["ratios_useful_tokens_per_cpu_s"].items():
        target = report["target"].get(k)
        print(f"  {k}: {v:.2f}x (useful tokens per CPU second{f'; target {target}x' if target else ''})")


if __name__ == "__main__":
    sys.exit(main())
