"""torch.compile per decoder layer (`train.compile`), and the graph breaks it met.

Each decoder layer is compiled in place with `nn.Module.compile()` (inductor, default mode): the module
keeps its name, parameters and hooks, and `Module.__call__` runs the compiled `_call_impl`. The repeated
layers share one compiled graph (same code, same shapes and dtypes: dynamo guards on them), so a model of
32 layers compiles about one layer's worth.

The order, and why it works with zerofit's other levers:

- **checkpoint outside, compile inside.** transformers' `GradientCheckpointingLayer.__call__` calls
  (non-reentrant) `torch.utils.checkpoint` on `Module.__call__`, which is the compiled forward: the
  recomputation in backward reruns the compiled graph, and the checkpoint's saved-tensor hooks stay
  outside the compiled region (dynamo does not trace them).
- **activation offload** (`zerofit.levers.offload`) wraps the checkpoint call with its saved-tensor hooks, so it is
  outside the compiled region too and sees exactly the layer inputs it sees in eager mode.
- **tiled MLP** (`zerofit.levers.tiling`) and **lean RMSNorm** (`zerofit.levers.norms`) are custom autograd functions
  inside the layer; dynamo traces what it can and breaks the graph where it cannot (counted below).
- **LoRA**: peft's adapted linears are ordinary submodules of the layer, compiled with it.
- **Engines**: the layers are compiled before the strategy wraps the model (torchtitan's order: compile
  each block, then `fully_shard` it). FSDP2's per-layer hooks are skipped by dynamo
  (`torch._dynamo.config.skip_fsdp_hooks`, the default) and run eagerly around the compiled body; DDP and
  DeepSpeed ZeRO-1/2 hook the parameters' gradients, which compiled backward still produces one per
  micro-step. ZeRO-3 gathers every submodule's parameters in module hooks inside the layer; DeepSpeed
  marks them `torch.compiler.disable`, so they run eagerly and break the layer's graph around every
  parameterized submodule (counted below: little is fused there).

Graph breaks: dynamo counts them in `torch._dynamo.utils.counters["graph_break"]` (reason -> count) as it
compiles, which happens at the first forward of each new shape; `graph_breaks()` sums them, and the training
loop logs the running total as `compile/graph_breaks` in metrics.jsonl (0 is a layer that compiled whole).

Equality: the same ops, fused and reordered by inductor, so equal up to rounding: on the tiny model in fp32
the loss curve within 1e-5 relative of the eager run's (tests/unit/levers/test_speed_levers.py; on 2 ranks
tests/distributed/test_equivalence.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["compile_decoder_layers", "describe_compile", "graph_break_reasons", "graph_breaks"]


def compile_decoder_layers(layers: list[Any]) -> int:
    """Compile each decoder layer in place (`nn.Module.compile`); returns how many were compiled."""
    for layer in layers:
        layer.compile()
    return len(layers)


def graph_break_reasons() -> dict[str, int]:
    """Dynamo's graph breaks in this process so far: reason -> how many times it broke a graph."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def graph_breaks() -> int:
    """How many graph breaks dynamo met in this process so far (0 before the first compiled forward)."""
    return sum(graph_break_reasons().values())


def describe_compile(compiled_layers: int, checkpointed_layers: int = 0) -> str:
    """The plan's line: what is compiled, where it sits against checkpointing, where graph breaks go."""
    if compiled_layers <= 0:
        return "off (eager)"
    where = ", inside the checkpoint of the checkpointed ones" if checkpointed_layers > 0 else ""
    return (
        f"torch.compile of {compiled_layers} decoder layers (inductor{where}); graph breaks counted from "
        "the first step: metrics.jsonl compile/graph_breaks"
    )
