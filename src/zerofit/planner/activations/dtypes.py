"""Per-element byte sizes of a decoder layer's tensors under a compute profile (from `zerofit.core.precision`):
the residual stream, a base linear's output, attention's saves, the logits, the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerofit.core.precision import dtype_bytes
from zerofit.planner.scenario import ComputeProfile, Scenario, compute_profile


@dataclass(frozen=True)
class LayerDtypes:
    """Per-element byte sizes of the tensors in a decoder layer under a compute profile."""

    resid: int  # residual stream (embedding output dtype)
    lin_out: int  # output of a base linear
    att: int  # tensors attention saves
    logits: int
    adapter: int  # LoRA compute dtype without autocast
    autocast_half: int | None  # half dtype when autocast is on


def layer_dtypes(scn: Scenario, prof: ComputeProfile) -> LayerDtypes:
    """The element sizes of `scn`'s layer tensors: the engine's cast, k-bit preparation's fp32 residual
    stream, the load dtype and autocast decide which dtype each kind of tensor is in."""
    half_b = prof.half_bytes
    if prof.cast_params_to is not None:
        store = half_b  # DeepSpeed / FSDP2: everything computes in the half dtype
        adapter = half_b
    else:
        # k-bit preparation upcasts norms and embeddings to fp32 (quantization.fp32_residual); without it
        # the residual stream stays in the compute dtype.
        kbit_fp32 = scn.quantization != "none" and scn.fp32_residual
        store = dtype_bytes("fp32" if kbit_fp32 else prof.load)
        if scn.quantization != "none" and not scn.fp32_residual:
            store = half_b
        adapter = 4
    resid = store
    ac = half_b if prof.autocast else None
    # bitsandbytes returns its output in the input's dtype; otherwise autocast or the weights decide.
    lin_out = resid if scn.quantization != "none" else (ac or store)
    att = ac or lin_out
    logits = ac or store
    return LayerDtypes(
        resid=resid, lin_out=lin_out, att=att, logits=logits, adapter=adapter, autocast_half=ac
    )


def residual_bytes(scn: Scenario) -> int:
    """Bytes per element of the residual stream (what a checkpointed layer input is stored in)."""
    return layer_dtypes(scn, compute_profile(scn)).resid
