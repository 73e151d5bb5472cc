"""Apply rendered FSDP plans (`fsdp.json` dicts) with a real `fully_shard` on the tiny Llama, in 1 process.

Run as a subprocess by test_render.py (so the gloo process group never leaks into other tests):
`python _fsdp_probe.py PLANS.json` prints one JSON line per plan with what was built and what one
accumulation window did. Everything the plan says is taken from the dict: policies, wrapped class, sync.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from zerofit.catalogue.models import TINY_LLAMA_CONFIG


def apply_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """Shard a fresh tiny model as `plan` says, run up to 2 micro-steps and one optimizer step."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG))
    mesh = init_device_mesh(
        plan["mesh"]["device_type"], (dist.get_world_size(),), mesh_dim_names=tuple(plan["mesh"]["dim_names"])
    )
    mp = plan["mixed_precision"]
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": plan["reshard_after_forward"],
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=getattr(torch, mp["param_dtype"]),
            reduce_dtype=getattr(torch, mp["reduce_dtype"]),
            output_dtype=getattr(torch, mp["output_dtype"]),
        ),
        "offload_policy": CPUOffloadPolicy(pin_memory=plan["cpu_offload_pin_memory"])
        if plan["cpu_offload"]
        else OffloadPolicy(),
    }
    layers = [m for m in model.modules() if type(m).__name__ == plan["wrap"]["layer_class"]]
    for layer in layers:
        fully_shard(layer, **kwargs)
    if plan["wrap"]["root"]:
        fully_shard(model, **kwargs)
    model.set_gradient_divide_factor(plan["gradient_divide_factor"])

    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = min(plan["gradient_accumulation"]["grad_accum_steps"], 2)
    logits_dtype = None
    for i in range(steps):
        is_last = i == steps - 1
        model.set_requires_gradient_sync(
            is_last or plan["gradient_accumulation"]["sync"] == "every_micro_step"
        )
        ids = torch.randint(3, 128, (2, 8))
        out = model(input_ids=ids, labels=ids)
        logits_dtype = str(out.logits.dtype).removeprefix("torch.")
        out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    optimizer.step()
    after = [p.detach().full_tensor() for p in model.parameters()]
    return {
        "preset": plan["preset"],
        "param_dtype": mp["param_dtype"],
        "sharded_layers": len(layers),
        "root_is_fsdp": type(model).__name__.startswith("FSDP"),
        "logits_dtype": logits_dtype,
        "all_grads": all(g is not None for g in grads),
        "grad_dtypes": sorted({str(g.dtype).removeprefix("torch.") for g in grads if g is not None}),
        "grad_devices": sorted({g.device.type for g in grads if g is not None}),
        "params_changed": sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "n_params": len(before),
    }


def main() -> None:
    plans = json.loads(Path(sys.argv[1]).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            for plan in plans:
                print(json.dumps(apply_plan(plan)), flush=True)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
