"""The baseline zerofit is measured against: Hugging Face Trainer + peft LoRA on the same examples.

What a user would write without zerofit: `get_peft_model` (LoRA r16, alpha 32, dropout 0.05 on all linear
layers), `Trainer` with `per_device_train_batch_size` x `gradient_accumulation_steps` = the same global
batch, gradient checkpointing (non-reentrant) as the shipped 3090 recipe, AdamW (torch), cosine schedule,
clipping at 1.0, bf16 (fp32 on request), and a collator that right-pads each micro-batch to its longest
example (labels -100 on padding), which is what HF's seq2seq / completion collators do.

Measured: the time of every optimizer step (Trainer callbacks, CUDA synchronized; wall and process CPU
time), after one warm-up step; label, useful (non-pad) and processed tokens of the same steps, counted at the model's forward;
peak allocated / reserved memory on CUDA (reset after the warm-up step). The first version of this script
measured the GPU baseline of docs/platform.md (2026-12-01: 6,959 tokens/s at 4 x 1024, 15.74 GiB).

    python benchmarks/hf_baseline.py --model-dir DIR --workload max_length --micro 4 --gas 8 --seq 1024 \
        --steps 2 --cap-gib 24 --out result.json          (one JSON line is also printed: HF_BASELINE {...})

HF's best long-context setup (the `long-hf-*` cases of gpu_fit.py): `--collator flatten` (padding-free
packing, `transformers.DataCollatorWithFlattening`: a micro-batch is one row of its examples end to end,
position ids restarting at each, no attention mask, no padding), `--attn auto` (flash_attention_2 where
`flash_attn` is installed and CUDA is there, else sdpa), `--liger auto` (`use_liger_kernel=True` where
`liger_kernel` is installed and CUDA is there: its fused linear cross-entropy never holds the logits), and
`--load-in-4bit` for QLoRA (NF4, double quantization, bf16 compute, `prepare_model_for_kbit_training`,
paged 8-bit AdamW, as the zerofit QLoRA recipe). The choices made are in the result (`attn`, `liger`,
`collator`, `load_in_4bit`).

`train_hf` is the same measurement as a function (the CPU benchmark calls it in-process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerofit.data import Example

GIB = 2**30
RESULT_PREFIX = "HF_BASELINE "


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA adapters HF's side gets (peft's `LoraConfig`): the baseline's r16 / alpha 32 / dropout 0.05
    on all linear layers unless a caller passes a run config's."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: str | list[str] = "all-linear"


def train_hf(
    model_dir: str,
    examples: list[Example],
    *,
    micro: int,
    gas: int,
    steps: int,
    precision: str = "bf16",
    checkpointing: bool = True,
    cap_gib: float | None = None,
    seed: int = 42,
    output_dir: str = "/tmp/hf-baseline",
    collator: str = "pad",
    attn: str = "sdpa",
    liger: bool = False,
    load_in_4bit: bool = False,
    lr: float = 2e-4,
    warmup_steps: int = 0,
    lora: LoraSettings | None = None,
    evaluate: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`steps` + 1 optimizer steps of HF Trainer + peft on `examples` (the first is warm-up).

    `collator`: "pad" (right-pad each micro-batch to its longest example) or "flatten"
    (`DataCollatorWithFlattening`: padding-free). `attn`: the attention implementation; `liger`:
    `use_liger_kernel`; `load_in_4bit`: QLoRA (bitsandbytes NF4) instead of a bf16 / fp32 base.
    `lr`, `warmup_steps` (cosine schedule) and `lora` (default: `LoraSettings()`) set the training; the
    quality benchmark passes a run config's. `evaluate(peft_model)`, when given, runs after training and
    its dict is the result's `evaluation`."""
    with _without_one_process_rendezvous():
        return _train_hf(**locals())


@contextmanager
def _without_one_process_rendezvous() -> Iterator[None]:
    """HF's Trainer as a plain one-process `python` run sees it: without the rendezvous variables of a world
    of 1 (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_*), which zerofit's `launch_env` exports into this
    process when a benchmark ran zerofit first. With them, accelerate starts a one-rank gloo group and the
    Trainer wraps the model in DistributedDataParallel (find_unused_parameters=True): an allreduce and an
    extra autograd traversal per step that a user's one-process HF run does not pay. A real multi-rank
    launch (WORLD_SIZE > 1) is left as it is."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {key: os.environ[key] for key in keys if key in os.environ}
    one_process = saved.get("WORLD_SIZE") == "1"
    if one_process:
        for key in saved:
            del os.environ[key]
    try:
        yield
    finally:
        if one_process:
            os.environ.update(saved)


def _train_hf(
    model_dir: str,
    examples: list[Example],
    *,
    micro: int,
    gas: int,
    steps: int,
    precision: str,
    checkpointing: bool,
    cap_gib: float | None,
    seed: int,
    output_dir: str,
    collator: str,
    attn: str,
    liger: bool,
    load_in_4bit: bool,
    lr: float,
    warmup_steps: int,
    lora: LoraSettings | None,
    evaluate: Callable[[Any], dict[str, Any]] | None,
) -> dict[str, Any]:
    """`train_hf`'s measurement (see there)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    cuda = torch.cuda.is_available()
    if cuda and cap_gib is not None:
        _, total = torch.cuda.mem_get_info()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    # peft draws the LoRA A matrices from torch's RNG before the Trainer seeds it: seed first, as a user's
    # script would (transformers.set_seed), so the run repeats from its seed.
    set_seed(seed)
    model = _load_base(model_dir, dtype, attn, load_in_4bit, cuda, checkpointing)
    lora = lora or LoraSettings()
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        ),
    )
    pad_id = int(model.config.pad_token_id or 0)
    rows = examples[: micro * gas * (steps + 1)]

    class Examples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict[str, list[int]]:
            return {"input_ids": rows[i].input_ids, "labels": rows[i].labels}

    def pad_to_longest(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), pad_id, dtype=torch.long)
        labels = torch.full((len(features), width), -100, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    counted = {"label": 0, "useful": 0, "processed": 0}

    def count_tokens(_module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        mask, labels = kwargs.get("attention_mask"), kwargs.get("labels")
        if mask is not None:
            counted["useful"] += int(mask.sum())
            counted["processed"] += mask.numel()
        elif kwargs.get("input_ids") is not None:  # flattened: no mask, no padding, every position useful
            counted["useful"] += kwargs["input_ids"].numel()
            counted["processed"] += kwargs["input_ids"].numel()
        if labels is not None:
            counted["label"] += int((labels[:, 1:] != -100).sum())

    model.register_forward_pre_hook(count_tokens, with_kwargs=True)

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.start = self.cpu_start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            counted.update(label=0, useful=0, processed=0)
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            cpu = time.process_time() - self.cpu_start
            self.steps.append({"seconds": time.perf_counter() - self.start, "cpu_seconds": cpu, **counted})
            if len(self.steps) == 1 and cuda:
                torch.cuda.reset_peak_memory_stats()

    timer = Timer()
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=gas,
        max_steps=steps + 1,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=warmup_steps,
        max_grad_norm=1.0,
        bf16=precision == "bf16",
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        optim="paged_adamw_8bit" if load_in_4bit else "adamw_torch",
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        seed=seed,
        use_liger_kernel=liger,
    )
    if collator == "flatten":
        from transformers import DataCollatorWithFlattening

        # flash-attention reads the sequence boundaries from these kwargs; sdpa from the position ids.
        collate: Any = DataCollatorWithFlattening(return_flash_attn_kwargs=attn == "flash_attention_2")
    else:
        collate = pad_to_longest
    trainer = Trainer(
        model=model, args=args, train_dataset=Examples(), data_collator=collate, callbacks=[timer]
    )
    result: dict[str, Any] = {
        "micro": micro,
        "gas": gas,
        "checkpointing": checkpointing,
        "precision": precision,
        "cap_gib": cap_gib,
        "collator": collator,
        "attn": attn,
        "liger": liger,
        "load_in_4bit": load_in_4bit,
    }
    try:
        output = trainer.train()
        steady = timer.steps[1:] or timer.steps
        seconds = sum(s["seconds"] for s in steady)
        result.update(
            ok=True,
            step_times=[round(s["seconds"], 4) for s in timer.steps],
            step_time_s=round(seconds / len(steady), 4),
            tokens_per_s=round(sum(s["label"] for s in steady) / seconds, 1),
            useful_tokens_per_s=round(sum(s["useful"] for s in steady) / seconds, 1),
            processed_tokens_per_s=round(sum(s["processed"] for s in steady) / seconds, 1),
            cpu_s_per_step=round(sum(s["cpu_seconds"] for s in steady) / len(steady), 4),
            useful_tokens_per_cpu_s=round(
                sum(s["useful"] for s in steady) / sum(s["cpu_seconds"] for s in steady), 1
            ),
            train_loss_mean=round(float(output.training_loss), 5),
        )
        if evaluate is not None:
            result["evaluation"] = evaluate(model)
        if cuda:
            result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
    except torch.cuda.OutOfMemoryError as exc:
        result.update(ok=False, oom=True, error=str(exc).splitlines()[0][:300])
        if cuda:
            result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    return result


def _load_base(
    model_dir: str, dtype: Any, attn: str, load_in_4bit: bool, cuda: bool, checkpointing: bool
) -> Any:
    """The base model as a user would load it: bf16 / fp32 on the GPU, or 4-bit NF4 prepared for k-bit
    training (its norms, embeddings and head cast to fp32, as peft's QLoRA recipe and zerofit's do)."""
    from transformers import AutoModelForCausalLM

    if not load_in_4bit:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
        return model.cuda() if cuda else model
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        attn_implementation=attn,
        quantization_config=quant,
        device_map={"": 0} if cuda else {"": "cpu"},
    )
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)


def resolve_auto(attn: str, liger: str) -> tuple[str, bool]:
    """`--attn auto` / `--liger auto`: the fastest that is installed here (both need CUDA)."""
    import importlib.util

    import torch

    cuda = torch.cuda.is_available()
    if attn == "auto":
        attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    use_liger = liger == "on" or (
        liger == "auto" and cuda and importlib.util.find_spec("liger_kernel") is not None
    )
    return attn, use_liger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--workload", choices=["max_length", "real_length"], default="max_length")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--gas", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--collator", choices=["pad", "flatten"], default="pad")
    parser.add_argument("--attn", choices=["auto", "sdpa", "flash_attention_2", "eager"], default="sdpa")
    parser.add_argument("--liger", choices=["auto", "on", "off"], default="off")
    parser.add_argument("--load-in-4bit", action="store_true", help="QLoRA: a 4-bit NF4 base")
    parser.add_argument("--out", default=None, help="append the result as one JSON line to this file")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from transformers import AutoConfig

    from workloads import describe, workload

    vocab = int(AutoConfig.from_pretrained(args.model_dir).vocab_size)
    examples = workload(args.workload, args.micro * args.gas * (args.steps + 1), args.seq, vocab)
    attn, liger = resolve_auto(args.attn, args.liger)
    result = train_hf(
        args.model_dir,
        examples,
        micro=args.micro,
        gas=args.gas,
        steps=args.steps,
        precision=args.precision,
        checkpointing=not args.no_checkpointing,
        cap_gib=args.cap_gib,
        collator=args.collator,
        attn=attn,
        liger=liger,
        load_in_4bit=args.load_in_4bit,
    )
    result.update(workload=args.workload, seq=args.seq, data=describe(examples))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if result.get("ok") else 3


if __name__ == "__main__":
    sys.exit(main())
