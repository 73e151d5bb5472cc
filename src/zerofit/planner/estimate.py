"""The analytic memory model: per-rank peak GPU memory of one training step, with a breakdown to check by hand.

Everything is counted in bytes from the model's exact shapes (`shapes.py`) and what zerofit's engines do
(`models/build.py`, `strategies/`, `loop/train.py`), then reported in GiB. The model mirrors, term by term, what a
tensor-level trace of the step sees (`trace.py`), and the tests hold the two within 5% across a matrix.

Peak = max over the two phases of a step:

  forward/backward = resident state + gradients held from earlier micro-steps of the window
                     + activations at their peak (all layers' saved tensors, the logits and the loss's fp32
                       temporaries, or with checkpointing the layer inputs + one recomputed layer)
  optimizer step   = resident state + gradients + the optimizer's temporaries
  generation       = (online RL only: `rl.py`) resident state + the KV cache, the sampling logits and the
                     prefill's layer of the rank's rollout; the training phases then also hold the rollout

Resident state (`state.py`) = weights as the engine holds them (dtype, quantization, ZeRO / FSDP sharding,
offload) + optimizer state + master weights (DeepSpeed, mixed precision) + the engine's gradient buffers.
Activations: `activations/` (`activations.peak.activation_terms`).

`total` adds a stated allowance for what is not a tensor: the CUDA context, cuBLAS workspace, NCCL buffers and
caching-allocator fragmentation (constants below, documented where they are defined).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofit.core.precision import GIB, dtype_bytes
from zerofit.planner.activations.peak import activation_terms
from zerofit.planner.activations.vision import vision_notes, vision_terms
from zerofit.planner.rl import generation_lines, held_lines, rl_notes
from zerofit.planner.scenario import Scenario, compute_profile
from zerofit.planner.shapes import model_shape
from zerofit.planner.state import Place, model_state, param_counts, quantized_weight_bytes
from zerofit.planner.teacher import teacher_lines

# --- Allowance: device memory that is not a tensor (documented constants) --------------------------------
# The CUDA context (driver state, kernels of torch, cuBLAS and cuDNN loaded on first use) is not counted by
# torch.cuda.memory_allocated but occupies the card: about 0.3-0.5 GiB on Ampere/Hopper with torch 2.x.
CUDA_CONTEXT_GIB = 0.5
# cuBLAS/cuBLASLt workspaces and other per-stream scratch (a few MiB each, several streams).
WORKSPACE_GIB = 0.1
# NCCL communicator buffers when there is more than one rank.
NCCL_GIB = 0.3
# The caching allocator rounds blocks and cannot always reuse freed ones. Measured on an H200 capped at
# 24 GiB (docs/platform.md, 2026-12-01), reserved exceeded allocated by 10.4-12.3% for bf16 LoRA on ZeRO-2
# and 11.1% on FSDP2; 12.5% of the tensor peak is held back, so the predicted total covers the measured
# reserved + context in every one of those runs (by 0.1-4.3%).
FRAGMENTATION_FRACTION = 0.125
# A 4-bit base dequantizes each weight into a fresh compute-dtype buffer in every forward, recomputation
# and backward; those blocks fragment the cache further (QLoRA at 4 x 2048: reserved 29% above allocated).
# Held back: the dequantized weights of this many decoder layers (one layer of Llama-2-7B: 0.38 GiB in
# bf16), fitted to that one measurement (predicted total 1.1% above the measured reserved + context).
KBIT_DEQUANT_LAYERS = 5


@dataclass
class MemoryEstimate:
    """Per-rank peak GPU memory of one step, its breakdown (GiB) and the host RAM the run needs."""

    scenario: Scenario
    tensors_gib: float  # peak bytes of live tensors (comparable to a trace / torch.cuda.max_memory_allocated)
    total_gib: float  # tensors + allowance (what the card must hold)
    allowance_gib: float
    breakdown: dict[str, float]  # named GiB lines of the peak phase; they sum to tensors_gib
    allowance: dict[str, float]
    peak_phase: str
    phases_gib: dict[str, float]
    host_ram_gib: float
    host_breakdown: dict[str, float]
    per_layer_token_bytes: dict[str, int]
    notes: list[str]

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (the `memory` block of `zerofit plan --json`)."""
        images = self.scenario.images
        seen = {} if images is None else {"image_tokens": {"micro_batch": self.scenario.image_tokens,
                                                           "largest_image": images.largest_image,
                                                           "source": images.source}}  # fmt: skip
        return {
            **seen,
            "tensors_gib": round(self.tensors_gib, 3),
            "total_gib": round(self.total_gib, 3),
            "allowance_gib": round(self.allowance_gib, 3),
            "breakdown": {k: round(v, 4) for k, v in self.breakdown.items()},
            "allowance": {k: round(v, 3) for k, v in self.allowance.items()},
            "peak_phase": self.peak_phase,
            "phases_gib": {k: round(v, 3) for k, v in self.phases_gib.items()},
            "host_ram_gib": round(self.host_ram_gib, 2),
            "host_breakdown": {k: round(v, 3) for k, v in self.host_breakdown.items()},
            "activation_bytes_per_token_per_layer": self.per_layer_token_bytes,
            "micro_batch_size": self.scenario.micro_batch_size,
            "seq_len": self.scenario.seq_len,
            "objective": self.scenario.objective.name,
            "reference": self.scenario.reference,
            "sequences_per_micro_batch": self.scenario.rows,
            "notes": self.notes,
        }


def allowance_gib(tensors_gib: float, dp_size: int, dequant_gib: float = 0.0) -> dict[str, float]:
    """The non-tensor device memory held back on top of the tensor peak (see the constants above).

    `dequant_gib`: one decoder layer's weights dequantized to the compute dtype (k-bit bases only).
    """
    out = {
        "CUDA context": CUDA_CONTEXT_GIB,
        "cuBLAS workspace": WORKSPACE_GIB,
        f"allocator fragmentation ({FRAGMENTATION_FRACTION:.1%} of tensors)": FRAGMENTATION_FRACTION
        * tensors_gib,
    }
    if dequant_gib:
        out[f"4/8-bit dequantization blocks ({KBIT_DEQUANT_LAYERS} layers' weights)"] = (
            KBIT_DEQUANT_LAYERS * dequant_gib
        )
    if dp_size > 1:
        out["NCCL buffers"] = NCCL_GIB
    return out


def _dequant_layer_gib(scn: Scenario) -> float:
    """One decoder layer's linear weights in the compute dtype, for a k-bit base (else 0)."""
    if scn.quantization == "none":
        return 0.0
    prof = compute_profile(scn)
    half_b = prof.half_bytes
    return model_shape(scn.model).layer_linear_weight_params * half_b / GIB


def ulysses_buffer_bytes(scn: Scenario) -> int:
    """Ulysses sequence parallelism's exchange buffers of one layer (0 without it): the shard's q, k and v
    sent and received by the all-to-all (DeepSpeed's `_combine_local_sequences` makes each contiguous
    before the exchange and receives into a new tensor), two copies in the compute dtype."""
    if scn.sequence_parallel <= 1:
        return 0
    shape = model_shape(scn.model)
    width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    compute_bytes = dtype_bytes(scn.precision)
    return 2 * scn.rows * scn.shard_seq_len * width * compute_bytes


def _rank_shard(scn: Scenario) -> Scenario:
    """What one rank's activations are of. Ulysses: its sequence shard (attention too: the whole sequence
    for 1/N of the heads holds as many numbers); the exchange's buffers are `ulysses_buffer_bytes`."""
    return scn.with_levers(seq_len=scn.shard_seq_len) if scn.sequence_parallel > 1 else scn


def _rl_lines(scn: Scenario) -> tuple[dict[str, int], dict[str, int]]:
    """(the generation phase's lines, the lines held through training) of an online-RL step; empty else.
    A distillation teacher (`teacher.py`) is held in both; its logits count in training (the forward's;
    the optimizer step is never the larger phase by them: the gradients' bytes are freed logits' too)."""
    if scn.rl is None:
        return {}, {}
    prof = compute_profile(scn)
    generating = generation_lines(scn.rl, model_shape(scn.model), prof.half_bytes)
    held = held_lines(scn.rl)
    if scn.teacher is not None:
        load = dtype_bytes(prof.load)
        weights, logits = teacher_lines(
            scn.teacher, scn.teacher_load_in, load, scn.micro_batch_size, scn.seq_len
        )
        generating.update(weights)
        held.update({**weights, **logits})
    return generating, held


def _image_lines(scn: Scenario, acts_peak: int) -> tuple[int, dict[str, int], bool]:
    """What a vision-language model's images add to the forward/backward peak (`activations.vision`): (bytes
    in place of the language model's activation peak, breakdown lines, whether the tower's own forward is the
    larger moment). A language model: (0, {}, False)."""
    vis = vision_terms(scn)
    lines = {f"activations: images: {k}": n for k, n in vis.held.items()}
    if vis.tower_forward > acts_peak:
        lines[f"activations: the frozen vision tower's forward ({vis.patches} patches)"] = vis.tower_forward
        return vis.held_bytes + vis.tower_forward, lines, True
    return vis.held_bytes + acts_peak, lines, False


def _engine_notes(scn: Scenario) -> list[str]:
    notes = []
    if scn.quantization != "none" and scn.zero_stage == 3:
        notes.append(
            "ZeRO-3 with k-bit base weights: the quantized weights are counted whole on every rank (an upper "
            "bound; ZeRO-3 partitions the non-quantized parameters)"
        )
    if scn.quantization != "none" and scn.strategy == "fsdp":
        notes.append(
            "FSDP2 with 4-bit base weights: the packed weights are sharded like any parameter (8-bit under "
            "FSDP2 is refused by resolve)"
        )
    if scn.rl is not None:
        notes.extend(rl_notes(scn.rl, scn.micro_batch_size, sum(_rl_lines(scn)[0].values())))
    return notes


def estimate(scn: Scenario) -> MemoryEstimate:
    """The analytic per-rank peak for `scn`, with a breakdown a reader can check by hand."""
    state = model_state(scn)
    acts = activation_terms(_rank_shard(scn), state.at(Place.IN_LAYER))
    exchange = ulysses_buffer_bytes(scn)
    generating, rollout = _rl_lines(scn)
    resident = state.bytes_at(Place.GPU)
    window = state.bytes_at(Place.WINDOW_GRADS)
    held = window if scn.grad_accum_steps > 1 else 0
    images, image_lines, tower_first = _image_lines(scn, acts.peak)
    fwd = resident + held + max(acts.peak, images) + exchange + sum(rollout.values())
    step = resident + window + state.bytes_at(Place.STEP_TEMPS) + sum(rollout.values())
    gen = resident + sum(generating.values()) if generating else 0
    # The peak phase's lines, as shown (label -> bytes).
    breakdown: dict[str, int] = state.labelled(Place.GPU)
    if gen > max(fwd, step):
        phase = "generation"
        breakdown.update(generating)
    elif fwd >= step:
        phase = f"forward/backward: {'the vision tower' if tower_first else acts.where}"
        if held:
            breakdown.update(
                {f"{line.label} held across the window": line.bytes for line in state.at(Place.WINDOW_GRADS)}
            )
        if not tower_first:
            breakdown.update({f"activations: {k}": n for k, n in acts.lines.items()})
        breakdown.update(image_lines)
        if exchange:
            breakdown[
                f"activations: Ulysses all-to-all buffers (q/k/v, 1 layer, 1/{scn.sequence_parallel})"
            ] = exchange
    else:
        phase = "optimizer step"
        breakdown.update(state.labelled(Place.WINDOW_GRADS))
        breakdown.update(state.labelled(Place.STEP_TEMPS))
    if phase != "generation":
        breakdown.update(rollout)
    tensors = max(fwd, step, gen)
    tensors_gib = tensors / GIB
    allowance = allowance_gib(tensors_gib, scn.zero_ranks, _dequant_layer_gib(scn))
    host = state.labelled(Place.HOST)
    host.update({t.label: t.bytes for t in acts.host})
    host_gib = sum(host.values()) / GIB
    phases = {"forward/backward": fwd / GIB, "optimizer step": step / GIB}
    if generating:
        phases["generation"] = gen / GIB
    return MemoryEstimate(
        scenario=scn,
        tensors_gib=tensors_gib,
        total_gib=tensors_gib + sum(allowance.values()),
        allowance_gib=sum(allowance.values()),
        breakdown={k: n / GIB for k, n in breakdown.items() if n},
        allowance=allowance,
        peak_phase=phase,
        phases_gib=phases,
        host_ram_gib=host_gib,
        host_breakdown={k: n / GIB for k, n in host.items() if n},
        per_layer_token_bytes={t.label: t.bytes for t in acts.per_layer_token_terms},
        notes=[*state.notes, *objective_notes(scn), *_engine_notes(scn), *vision_notes(scn)],
    )


def objective_notes(scn: Scenario) -> list[str]:
    """What the estimate counts for the scenario's objective (`ObjectiveSpec.planner_notes`; none for SFT)."""
    return scn.objective.planner_notes(scn.micro_batch_size, scn.rows, scn.seq_len, scn.reference)


def untraced_state(scn: Scenario) -> tuple[int, int | None, list[str]]:
    """What the fake-tensor trace cannot see: (resident bytes to add, optimizer-step peak or None, notes).

    The trace runs the model (weights in the engine's compute dtypes, unsharded), autograd and, for
    `single`/`ddp` with AdamW, the real torch optimizer. Engine-owned state comes from `model_state`:
    every resident line the trace does not measure (master weights, partitions, buckets, 8-bit optimizer
    state), minus unsharded weights the engine does not hold (ZeRO-3, FSDP). Quantized weights are traced
    as half-precision stand-ins and swapped for their quantized bytes. When the optimizer step itself is
    not traced, its peak is the analytic one (returned second).
    """
    prof = compute_profile(scn)
    state = model_state(scn)
    counts = param_counts(scn)
    notes: list[str] = []
    added = 0
    for line in state.at(Place.GPU) + state.at(Place.IN_LAYER):
        if not line.traced:
            added += line.bytes
            notes.append(f"added analytically: {line.label} ({line.bytes / GIB:.3f} GiB)")
    if state.trace_weight_surplus:
        added -= state.trace_weight_surplus
        notes.append(
            f"unsharded weights the engine does not hold: -{state.trace_weight_surplus / GIB:.3f} GiB"
        )
    if counts.quantized and scn.strategy != "fsdp":
        half_b = prof.half_bytes
        quant_b = sum(quantized_weight_bytes(o, i, scn) for o, i in counts.quantized_linears) * counts.layers
        added += quant_b - counts.quantized * half_b
        notes.append("quantized weights: traced as half-precision stand-ins, swapped for their 4/8-bit bytes")
    step = None
    if not prof.traced_optimizer:
        step = state.bytes_at(Place.GPU, Place.WINDOW_GRADS, Place.STEP_TEMPS)
        notes.append("optimizer step (not traceable for this engine/optimizer): analytic")
    return added, step, notes
