"""`zerofit plan --probe`: find the largest micro-batch that fits by running real steps on the GPU.

The analytic planner predicts; the probe measures. For each micro-batch size that divides the per-rank
samples of the global batch (largest first), a fresh child process builds the run exactly as the launcher
does (`zerofit.recipe.assembly.assemble`: the same spec, strategy, model placement and optimizer), runs two
optimizer steps on synthetic
max-length micro-batches (padded, so attention takes the masked path) and reports
`torch.cuda.max_memory_allocated()` / `max_memory_reserved()`. A `torch.cuda.OutOfMemoryError` marks
the size as too big and the next smaller one is tried; the first that completes is the answer. The
global batch never changes: accumulation is re-derived for every candidate.

Each candidate runs in its own process because an OOM can leave the CUDA caching allocator, NCCL or a
DeepSpeed engine in a state that would falsify the next measurement. With `--world-size N` (N > 1) the
child is started with `torchrun --nproc_per_node N`, so sharded engines are measured as they will run.

Needs CUDA: without a GPU it refuses with a `LaunchError` saying to use the analytic plan instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.core.errors import LaunchError
from zerofit.core.precision import GIB

RESULT_PREFIX = "ZEROFIT_PROBE_RESULT "
PROBE_STEPS = 2  # the first step creates the optimizer state; the second is what steady state looks like


@dataclass(frozen=True)
class ProbeResult:
    """One candidate's outcome."""

    micro_batch_size: int
    grad_accum_steps: int
    ok: bool
    oom: bool
    peak_allocated_gib: float | None
    peak_reserved_gib: float | None
    seconds: float
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def require_cuda() -> None:
    """Refuse clearly when there is no GPU to probe on."""
    import torch

    if not torch.cuda.is_available():
        raise LaunchError(
            "zerofit plan --probe runs real training steps on a GPU, and no CUDA device is visible here; "
            "run it on the machine you will train on, or use the analytic plan (zerofit plan --gpu NAME)"
        )


def probe_micro_batches(
    config_data: dict[str, Any],
    world_size: int,
    candidates: list[int],
    per_rank: int,
    timeout_s: float = 1800,
) -> list[ProbeResult]:
    """Try `candidates` (largest first) in child processes; stop at the first that completes."""
    require_cuda()
    results: list[ProbeResult] = []
    with tempfile.TemporaryDirectory(prefix="zerofit-probe-") as tmp:
        cfg_file = Path(tmp) / "config.json"
        cfg_file.write_text(json.dumps(config_data))
        for micro in sorted(candidates, reverse=True):
            result = _run_child(cfg_file, world_size, micro, per_rank // micro, timeout_s)
            results.append(result)
            if result.ok:
                break
    return results


def _run_child(cfg_file: Path, world_size: int, micro: int, gas: int, timeout_s: float) -> ProbeResult:
    module = ["-m", "zerofit.recipe.probe", "--config-json", str(cfg_file), "--micro", str(micro)]
    if world_size > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}", *module]
    else:
        cmd = [sys.executable, *module]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return ProbeResult(micro, gas, False, False, None, None, time.perf_counter() - start, "timed out")
    seconds = time.perf_counter() - start
    reports = [
        json.loads(line[len(RESULT_PREFIX) :])
        for line in proc.stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    if reports:
        peak = max(r.get("peak_allocated_gib") or 0.0 for r in reports)
        reserved = max(r.get("peak_reserved_gib") or 0.0 for r in reports)
        ok = all(r["ok"] for r in reports) and proc.returncode == 0
        oom = any(r.get("oom") for r in reports)
        error = next((r.get("error") for r in reports if r.get("error")), None)
        return ProbeResult(micro, gas, ok, oom, peak or None, reserved or None, seconds, error)
    oom = "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return ProbeResult(micro, gas, False, oom, None, None, seconds, tail[0][:300])


def _child(config_json: str, micro: int) -> int:
    """Build the configured run at this micro-batch and run PROBE_STEPS optimizer steps; report peaks."""
    import torch

    from zerofit.config.schema import ZerofitConfig
    from zerofit.resolution import resolve
    from zerofit.strategies.env import launch_env

    env = launch_env()
    data = json.loads(Path(config_json).read_text())
    data["batch"]["micro_batch_size"] = micro
    data["batch"]["grad_accum_steps"] = None
    data.setdefault("train", {})["max_steps"] = PROBE_STEPS
    data["train"]["epochs"] = None  # the probe's length is its own (train.epochs needs the data)
    data.setdefault("logging", {}).setdefault("wandb", {})["mode"] = "disabled"
    cfg = ZerofitConfig.model_validate(data)
    result: dict[str, Any] = {"ok": False, "oom": False, "micro_batch_size": micro}
    run = None
    try:
        from zerofit.loop.train import train_step
        from zerofit.recipe.assembly import assemble

        run = assemble(resolve(cfg, env.world_size), with_data=False)
        vocab = int(getattr(run.built.model.config, "vocab_size", 32000))
        pad = int(run.built.tokenizer.pad_token_id or 0)
        plan, objective, resolved_cfg = run.plan.batch, run.plan.objective, run.plan.config
        seq = objective.max_tokens_per_unit(resolved_cfg)[0]
        torch.cuda.reset_peak_memory_stats()
        for _ in range(PROBE_STEPS):
            # The objective's own micro-batch layout (`ObjectiveSpec.synthetic_batch`), at its longest.
            shape = (micro, seq, vocab, pad, resolved_cfg)
            batches = [objective.synthetic_batch(*shape) for _ in range(plan.grad_accum_steps)]
            train_step(
                run.strategy,
                run.model,
                batches,
                cfg.train.max_grad_norm,
                cfg.train.cross_entropy,
                run.objective,
            )
        torch.cuda.synchronize()
        result["ok"] = True
    except torch.cuda.OutOfMemoryError as exc:
        result["oom"] = True
        result["error"] = str(exc).splitlines()[0][:300]
    finally:
        if torch.cuda.is_available():
            result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        if run is not None:
            # Teardown after an OOM may fail too; it must not hide the result already printed.
            with contextlib.suppress(Exception):
                run.close()
    return 0 if result["ok"] else 3


def main(argv: list[str] | None = None) -> int:
    """Child entry point: `python -m zerofit.recipe.probe --config-json FILE --micro N`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--micro", type=int, required=True)
    args = parser.parse_args(argv)
    return _child(args.config_json, args.micro)


if __name__ == "__main__":
    sys.exit(main())
