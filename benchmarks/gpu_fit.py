"""Do the shipped 3090 recipes fit a 24 GB card, and does the planner predict their peak? (needs a GPU)

For each recipe this script
  1. caps the CUDA caching allocator at --cap-gib (default 24 GiB) with
     `torch.cuda.set_per_process_memory_fraction`, so a bigger card behaves like a 3090 for allocation;
  2. trains the recipe's exact pipeline (`zerofit.assembly.assemble`, as the launcher builds it, then
     `train_step`: the recipe's precision, LoRA/QLoRA, optimizer, checkpointing, batch split and model
     placement) on a Llama-2-7B-shaped model with
     random weights (written once to a local folder: nothing is downloaded) and synthetic max-length
     micro-batches (right-padded, like zerofit's collate);
  3. measures peak allocated / reserved memory over steady-state steps and tokens/s;
  4. compares with the planner for the same budget: predicted tensor peak vs `max_memory_allocated`,
     predicted total vs `max_memory_reserved` + CUDA context (`mem_get_info` before/after);
and writes one JSON file under benchmarks/results/ (gpu_fit-<gpu>-<utc time>.json).

Each recipe runs in its own child process (an OOM or a DeepSpeed engine must not leak into the next).
The FSDP recipe needs 2 GPUs and is skipped on one; the ZeRO-3 offload recipe needs ~140 GiB of host RAM
and is only run with --with-offload.

    python benchmarks/gpu_fit.py                       # LoRA + QLoRA recipes, 24 GiB cap
    python benchmarks/gpu_fit.py --with-offload --steps 4
    python benchmarks/gpu_fit.py --smoke               # CPU, tiny-llama, 2 steps: checks the script itself
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GIB = 2**30
BASE_MODEL = "meta-llama/Llama-2-7b-hf"  # shape only: the catalogue's config.json, random weights
RECIPES = {
    "lora": "configs/llama2-7b-lora-3090.yaml",
    "qlora": "configs/llama2-7b-qlora-3090.yaml",
    "full-zero3-offload": "configs/llama2-7b-full-zero3-offload-3090.yaml",
    "lora-2gpu-fsdp": "configs/mistral-7b-lora-2x3090-fsdp.yaml",
}
RESULT_PREFIX = "GPU_FIT_RESULT "


# ------------------------------------------------------------------------------------------ the model


def random_model_dir(name: str, cache: Path) -> Path:
    """A local HF folder with `name`'s config, random bf16 weights and a small tokenizer (built once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerofit.planner.shapes import hf_config
    from zerofit.tiny_llama import ensure_tiny_llama

    target = cache / name.replace("/", "--")
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    target.mkdir(parents=True, exist_ok=True)
    config = hf_config(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random init on the GPU: seconds instead of minutes on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    del model
    # Token ids in the benchmark are synthetic; the tokenizer only supplies a pad id.
    AutoTokenizer.from_pretrained(ensure_tiny_llama(0)).save_pretrained(target)
    return target


# ------------------------------------------------------------------------------------------ one recipe


def run_one(recipe: str, model_dir: str | None, cap_gib: float, steps: int, smoke: bool) -> dict[str, Any]:
    """Train `steps` optimizer steps of one recipe in this process; measure and compare with the planner."""
    import torch

    import zerofit.planner.search as search
    from zerofit.assembly import assemble
    from zerofit.config import load_config, resolve
    from zerofit.planner import choose_micro_batch
    from zerofit.planner.search import Budget, plan_memory
    from zerofit.probe import synthetic_batch
    from zerofit.strategies.env import launch_env
    from zerofit.train import train_step

    env = launch_env()
    cuda = torch.cuda.is_available() and not smoke
    out: dict[str, Any] = {"recipe": recipe, "config": RECIPES[recipe], "cap_gib": cap_gib, "ok": False}
    context_gib = 0.0
    if cuda:
        torch.cuda.set_device(env.local_rank)
        free0, total = torch.cuda.mem_get_info()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))
        context_gib = (total - free0) / GIB  # what the CUDA context took before any tensor
        out["device"] = torch.cuda.get_device_name()
        # `batch.micro_batch_size: auto` must plan for the capped budget, not the whole card.
        search.detected_gpu = lambda: (f"{out['device']} capped at {cap_gib} GiB", cap_gib)

    overrides = [
        "logging.wandb.mode=disabled",
        f"output_dir={tempfile.mkdtemp(prefix='gpu-fit-')}",
        f"train.max_steps={steps + 1}",
    ]
    if smoke:
        overrides += ["model.name_or_path=tiny-llama", "data.max_seq_len=64", "planner.gpu_memory_gib=1"]
    else:
        overrides.append(f"model.name_or_path={model_dir}")
    cfg = load_config(str(REPO / RECIPES[recipe]), overrides)
    run = assemble(resolve(cfg, env.world_size, choose_micro_batch), with_data=False)
    cfg, plan = run.resolved.config, run.spec.plan
    predicted = plan_memory(run.resolved, run.spec, Budget(cap_gib, f"cap {cap_gib} GiB"))
    out.update(
        {
            "batch": {
                "global": plan.global_batch_size,
                "micro": plan.micro_batch_size,
                "accum": plan.grad_accum_steps,
            },
            "seq_len": cfg.data.max_seq_len,
            "predicted": {
                "tensors_gib": round(predicted.estimate.tensors_gib, 3),
                "total_gib": round(predicted.estimate.total_gib, 3),
                "verdict": predicted.verdict,
                "peak_phase": predicted.estimate.peak_phase,
                "host_ram_gib": round(predicted.estimate.host_ram_gib, 1),
            },
        }
    )
    try:
        built, model, strategy = run.built, run.model, run.strategy
        vocab = int(getattr(built.model.config, "vocab_size", 32000))
        pad = int(built.tokenizer.pad_token_id or 0)
        seq = cfg.data.max_seq_len

        def one_step() -> float:
            batches = [
                synthetic_batch(plan.micro_batch_size, seq, vocab, pad) for _ in range(plan.grad_accum_steps)
            ]
            start = time.perf_counter()
            train_step(strategy, model, batches, cfg.train.max_grad_norm)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        one_step()  # creates the optimizer state (and compiles / warms up kernels)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = [one_step() for _ in range(steps)]
        tokens = plan.global_batch_size * seq  # every position is processed (one padded token aside)
        out["tokens_per_s"] = round(tokens / (sum(times) / len(times)), 1)
        out["step_time_s"] = round(sum(times) / len(times), 3)
        if cuda:
            allocated = torch.cuda.max_memory_allocated() / GIB
            reserved = torch.cuda.max_memory_reserved() / GIB
            out["measured"] = {
                "peak_allocated_gib": round(allocated, 3),
                "peak_reserved_gib": round(reserved, 3),
                "cuda_context_gib": round(context_gib, 3),
                "reserved_plus_context_gib": round(reserved + context_gib, 3),
            }
            out["predicted_vs_measured"] = {
                "tensors_over_allocated": round(predicted.estimate.tensors_gib / allocated - 1, 4),
                "total_over_reserved_plus_context": round(
                    predicted.estimate.total_gib / (reserved + context_gib) - 1, 4
                ),
            }
        out["ok"] = True
    except torch.cuda.OutOfMemoryError as exc:
        out["oom"] = True
        out["error"] = str(exc).splitlines()[0][:300]
        if cuda:
            out["measured"] = {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}
    finally:
        run.close()
    return out


# ------------------------------------------------------------------------------------------ the driver


def _child(recipe: str, args: argparse.Namespace, model_dir: Path | None) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        recipe,
        "--cap-gib",
        str(args.cap_gib),
        "--steps",
        str(args.steps),
    ]
    if model_dir is not None:
        cmd += ["--model-dir", str(model_dir)]
    if args.smoke:
        cmd.append("--smoke")
    nproc = 2 if recipe == "lora-2gpu-fsdp" else 1
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *cmd[1:]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=REPO)
    found = [
        json.loads(line[len(RESULT_PREFIX) :])
        for line in proc.stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    if found:
        result = found[0]
    else:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        result = {
            "recipe": recipe,
            "ok": False,
            "error": " | ".join(tail)[-600:],
            "returncode": proc.returncode,
        }
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=24.0, help="allocator cap emulating the card (GiB)")
    parser.add_argument(
        "--steps", type=int, default=3, help="measured optimizer steps after one warm-up step"
    )
    parser.add_argument(
        "--recipes", default="lora,qlora,lora-2gpu-fsdp", help=f"comma list of {', '.join(RECIPES)}"
    )
    parser.add_argument(
        "--with-offload", action="store_true", help="also run the ZeRO-3 offload recipe (~140 GiB RAM)"
    )
    parser.add_argument(
        "--cache", default=str(REPO / ".cache" / "gpu_fit"), help="where the random 7B model is written"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU + tiny-llama, to check the script without a GPU"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one:
        result = run_one(args.one, args.model_dir, args.cap_gib, args.steps, args.smoke)
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0 if result["ok"] else 3

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "gpu_fit.py measures GPU memory and needs a CUDA device (use --smoke to check the script on CPU)"
        )
        return 2
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if args.with_offload and "full-zero3-offload" not in recipes:
        recipes.append("full-zero3-offload")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    model_dirs: dict[str, Path] = {}
    results = []
    for recipe in recipes:
        if recipe == "lora-2gpu-fsdp" and gpus < 2 and not args.smoke:
            results.append({"recipe": recipe, "ok": False, "skipped": f"needs 2 GPUs, {gpus} visible"})
            continue
        if args.smoke and recipe == "lora-2gpu-fsdp":
            results.append({"recipe": recipe, "ok": False, "skipped": "smoke runs one process"})
            continue
        model_dir = None
        if not args.smoke:
            from zerofit.config import load_config

            base = load_config(str(REPO / RECIPES[recipe]), []).model.name_or_path
            if base not in model_dirs:
                model_dirs[base] = random_model_dir(base, Path(args.cache))
            model_dir = model_dirs[base]
        print(f"[gpu_fit] {recipe} ...", flush=True)
        results.append(_child(recipe, args, model_dir))
        print(f"[gpu_fit] {json.dumps(results[-1])}", flush=True)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {
        "script": "benchmarks/gpu_fit.py",
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "cap_gib": args.cap_gib,
        "steps": args.steps,
        "smoke": args.smoke,
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "smoke" if args.smoke else device.replace(" ", "_").replace("/", "_")
    path = RESULTS / f"gpu_fit-{tag}-{report['utc'].replace(':', '')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[gpu_fit] wrote {path}")
    for r in results:
        pred, meas = r.get("predicted", {}), r.get("measured", {})
        print(
            f"  {r['recipe']:20s} ok={r.get('ok')} predicted {pred.get('tensors_gib', '-')} GiB tensors / "
            f"{pred.get('total_gib', '-')} total; measured {meas.get('peak_allocated_gib', '-')} allocated / "
            f"{meas.get('reserved_plus_context_gib', '-')} reserved+context; {r.get('tokens_per_s', '-')} tok/s"
            + (f"  [{r.get('skipped') or r.get('error')}]" if not r.get("ok") else "")
        )
    return 0 if all(r.get("ok") or r.get("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
