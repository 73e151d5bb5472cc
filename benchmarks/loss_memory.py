"""What the loss holds at long length: unchunked, chunked and fused_linear (`train.cross_entropy`).

One loss step from the final hidden states: forward and backward of lm_head (a [vocab x hidden] Linear)
plus the token-sum cross-entropy, at --tokens tokens, for each implementation:

  unchunked     logits = lm_head(hidden); F.cross_entropy on their fp32 upcast
  chunked       logits = lm_head(hidden); zerofit's chunked loss (fp32 one chunk at a time)
  fused_linear  zerofit.token_loss.fused: the matmul and the loss chunk by chunk; no logits at all

Reported per implementation: the peak of tensor bytes live during the step above what was live before it
(the hidden states, the weight: `torch.cuda.max_memory_allocated` on CUDA, else torch's MemTracker, which
counts every tensor the ops create), the median wall time of --repeats steps, and the loss sum (the same
for all three). Then the ratios against `chunked`. Labels mask a prompt of 10% of every row, as SFT data do.

This is a measurement, not a test: nothing here asserts on time.

    python benchmarks/loss_memory.py                          # 8,192 tokens, vocab 32,000, hidden 256, fp32
    python benchmarks/loss_memory.py --frozen-head            # LoRA: the head gets no gradient
    python benchmarks/loss_memory.py --skip unchunked --tokens 32768 --json out.json
    python benchmarks/loss_memory.py --smoke                  # seconds: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from zerofit.token_loss.fused import fused_linear_token_sum
from zerofit.token_loss.sums import IGNORE_INDEX, chunk_tokens, shifted_targets, token_sum_loss

IMPLS = ("unchunked", "chunked", "fused_linear")
MIB = 2**20


def _loss_fn(impl: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    if impl == "fused_linear":
        return lambda h, w, labels: fused_linear_token_sum(h, w, None, shifted_targets(labels))
    return lambda h, w, labels: token_sum_loss(F.linear(h, w), labels, impl)


def _operands(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    rows = max(1, args.tokens // args.seq)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(rows, args.seq, args.hidden, generator=g).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).to(device, dtype)
    weight.requires_grad_(not args.frozen_head)
    labels = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    labels[:, : args.seq // 10] = IGNORE_INDEX
    return hidden, weight, labels.to(device)


def _step(
    fn: Callable[..., torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> float:
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels)
    loss.backward()
    return float(loss.detach())


def _peak_bytes(
    fn: Callable[..., torch.Tensor], operands: tuple[torch.Tensor, ...], device: torch.device
) -> int:
    """Peak tensor bytes of one step above what was live before it (operands, the gradients of a previous
    step freed first)."""
    hidden, weight, _ = operands
    hidden.grad = weight.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(fn, *operands)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        _step(fn, *operands)
    peak = sum(
        value
        for snap in tracker.get_tracker_snapshot("peak").values()
        for key, value in snap.items()
        if getattr(key, "value", str(key)) == "Total"
    )
    return peak


def measure(impl: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One implementation: peak bytes, median seconds per step, the loss sum."""
    operands = _operands(args, device)
    fn = _loss_fn(impl)
    loss = _step(fn, *operands)  # warm-up (and the value)
    peak = _peak_bytes(fn, operands, device)
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        _step(fn, *operands)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return {"impl": impl, "peak_mib": peak / MIB, "seconds": statistics.median(times), "loss_sum": loss}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--frozen-head", action="store_true", help="the head gets no gradient (LoRA)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip", default="", help="comma-separated implementations to leave out")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes: checks the script, measures nothing"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.seq, args.vocab, args.hidden, args.repeats = 256, 64, 1000, 32, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impls = [i for i in IMPLS if i not in set(args.skip.split(","))]
    tokens = max(1, args.tokens // args.seq) * args.seq
    print(
        f"loss step at {tokens:,} tokens, vocab {args.vocab:,}, hidden {args.hidden}, {args.dtype}, "
        f"{'frozen' if args.frozen_head else 'trainable'} head, chunks of {chunk_tokens(args.vocab):,} tokens, "
        f"{device.type} (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    results = [measure(impl, args, device) for impl in impls]
    for r in results:
        print(
            f"  {r['impl']:<13} peak {r['peak_mib']:>10,.1f} MiB   {r['seconds']:>8.3f} s   loss sum {r['loss_sum']:.6g}"
        )
    ref = next((r for r in results if r["impl"] == "chunked"), None)
    ratios = {}
    if ref is not None:
        for r in results:
            if r is not ref:
                ratios[r["impl"]] = {
                    "peak": r["peak_mib"] / ref["peak_mib"],
                    "time": r["seconds"] / ref["seconds"],
                }
                print(
                    f"  {r['impl']} / chunked: peak {ratios[r['impl']]['peak']:.3f}x, time {ratios[r['impl']]['time']:.3f}x"
                )
    if args.json is not None:
        report = {
            "setup": {**{k: v for k, v in vars(args).items() if k != "json"}, "tokens": tokens},
            "device": device.type,
            "machine": platform.machine(),
            "torch": torch.__version__,
            "results": results,
            "ratios_vs_chunked": ratios,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
