"""The GRPO baseline zerofit's `grpo` case of gpu_fit.py is measured against: TRL's GRPOTrainer at the same
settings.

What a user would write with TRL (1.16 here): the base model (bf16, or 4-bit NF4 with double quantization
and `prepare_model_for_kbit_training` for `--load-in-4bit`, as hf_baseline.py loads it), peft LoRA r16 /
alpha 32 / dropout 0 on all linear layers, `GRPOConfig` with G completions per prompt, `--micro` completions
per device batch x `--gas` accumulation (TRL's generation batch is their product: `--micro` x `--gas` / G
prompts per step, as zerofit's rl.prompts_per_step), the same max completion length, temperature 1, beta 0
(no reference model), DAPO's loss with epsilon 0.2 / epsilon_high 0.28, gradient checkpointing, transformers'
generate (no vLLM), and the same reward: zerofit's exact_match on the `answer` column (TRL passes the
data's other columns to a reward function as keyword lists).

Measured, as hf_baseline.py does: each optimizer step's wall time after one warm-up step (TRL generates a
step's completions inside that step: generation and training are both in it), and the peak allocated /
reserved CUDA memory of the steady steps.

    python benchmarks/trl_grpo_baseline.py --model-dir DIR --prompts prompts.jsonl --num-generations 8 \
        --micro 2 --gas 8 --max-completion-length 1024 --steps 2 --load-in-4bit --cap-gib 24
    (one JSON line is printed: TRL_GRPO_BASELINE {...})
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

GIB = 2**30
RESULT_PREFIX = "TRL_GRPO_BASELINE "


def _reward(column: str = "answer") -> Any:
    """zerofit's exact_match in TRL's reward signature (prompts, completions, **columns)."""
    from zerofit.objectives.grpo.rewards import exact_match

    score = exact_match(column)

    def exact_match_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return score([str(p) for p in prompts], texts, {column: list(kwargs[column])})

    return exact_match_reward


def _timer(times: list[float], peaks: list[dict[str, float]], cuda: bool) -> Any:
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        """Wall time of every optimizer step (CUDA synchronized); memory peaks reset after the warm-up."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
                if state.global_step > 1:
                    peaks.append(
                        {
                            "allocated": torch.cuda.max_memory_allocated() / GIB,
                            "reserved": torch.cuda.max_memory_reserved() / GIB,
                        }
                    )
                torch.cuda.reset_peak_memory_stats()
            times.append(time.perf_counter() - self.start)

    return StepTimer()


def train_trl_grpo(args: argparse.Namespace) -> dict[str, Any]:
    """One GRPOTrainer run of `args.steps` + 1 steps; the steady steps' time and memory."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from hf_baseline import _load_base

    cuda = torch.cuda.is_available()
    if cuda and args.cap_gib:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.cap_gib * GIB / torch.cuda.mem_get_info()[1])
        )
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = _load_base(args.model_dir, dtype, "sdpa", args.load_in_4bit, cuda, checkpointing=True)
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.gas,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=1e-5,
        max_steps=args.steps + 1,
        gradient_checkpointing=True,
        bf16=args.precision == "bf16",
        use_cpu=not cuda,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        optim="paged_adamw_8bit" if args.load_in_4bit else "adamw_torch",
    )
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    dataset = load_dataset("json", data_files=args.prompts, split="train")
    times: list[float] = []
    peaks: list[dict[str, float]] = []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[_reward()],
        args=config,
        train_dataset=dataset,
        peft_config=lora,
        callbacks=[_timer(times, peaks, cuda)],
    )
    trainer.train()
    steady = times[1:] or times
    out: dict[str, Any] = {
        "ok": True,
        "trl": __import__("trl").__version__,
        "steps": len(steady),
        "step_time_s": round(sum(steady) / len(steady), 3),
        "completions_per_step": args.micro * args.gas,
        "max_completion_length": args.max_completion_length,
        "load_in_4bit": args.load_in_4bit,
    }
    if peaks:
        out["peak_allocated_gib"] = round(max(p["allocated"] for p in peaks), 3)
        out["peak_reserved_gib"] = round(max(p["reserved"] for p in peaks), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL of {prompt, answer}")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2, help="completions per device batch")
    parser.add_argument("--gas", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--load-in-4bit", action="store_true")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    if args.output_dir is None:
        import tempfile

        args.output_dir = tempfile.mkdtemp(prefix="trl-grpo-")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        result = train_trl_grpo(args)
    except Exception as exc:  # an OOM or a TRL refusal is the measured answer, recorded
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
        }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
