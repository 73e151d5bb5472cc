"""The plans to choose among: a (micro-batch, checkpointed layers, levers) option with its peak and its
predicted speed (`speed.py`), the fastest that fit per micro-batch, the baseline the speed-up is measured
against, and the `auto` memory levers as variants (`lever_variants`): a lever costs time, so it is chosen
only where it makes a plan fit or lets a faster one fit (a tie keeps it off).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from zerofit.levers.recompute import describe_checkpointing
from zerofit.planner.estimate import estimate
from zerofit.planner.scenario import TILED_MLP_SHARDS, Scenario
from zerofit.planner.search.budget import Budget, verdict
from zerofit.planner.search.table import divisors
from zerofit.planner.shapes import model_shape
from zerofit.planner.speed import SpeedEstimate, predict_speed

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


@dataclass
class PlanOption:
    """One (micro-batch, checkpointed decoder layers) pair: its predicted memory and speed."""

    micro_batch_size: int
    grad_accum_steps: int
    checkpointed_layers: int
    num_layers: int
    tensors_gib: float
    total_gib: float
    verdict: str | None
    speed: SpeedEstimate
    tiled_mlp: int = 1  # MLP token shards (1 = off)
    activation_offload: bool = False
    lean_norm: bool = False
    cross_entropy: str = "chunked"

    @property
    def checkpointing(self) -> bool | int:
        """The `train.activation_checkpointing` value of this option (true, false or a layer count)."""
        if self.checkpointed_layers >= self.num_layers:
            return True
        return self.checkpointed_layers or False

    def describe(self) -> str:
        """E.g. `micro 8 x accum 4, checkpointing first 12 of 32 layers` (+ the levers it uses)."""
        ckpt = describe_checkpointing(self.checkpointed_layers, self.num_layers)
        out = f"micro {self.micro_batch_size} x accum {self.grad_accum_steps}, checkpointing {ckpt}"
        if self.tiled_mlp > 1:
            out += f", MLP in {self.tiled_mlp} token shards"
        out += ", inputs offloaded to host" if self.activation_offload else ""
        out += ", lean RMSNorms" if self.lean_norm else ""
        return out + (", the loss inside lm_head" if self.cross_entropy == "fused_linear" else "")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (the levers' keys only where the option uses them)."""
        out = {
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "checkpointed_layers": self.checkpointed_layers,
            "num_layers": self.num_layers,
            "tensors_gib": round(self.tensors_gib, 3),
            "total_gib": round(self.total_gib, 3),
            "verdict": self.verdict,
            "tokens_per_s": round(self.speed.tokens_per_s, 1),
            "step_time_s": round(self.speed.step_time_s, 3),
            "recompute_fraction": round(self.speed.recompute_fraction, 4),
        }
        if self.tiled_mlp > 1:
            out["tiled_mlp"] = self.tiled_mlp
        if self.activation_offload:
            out["activation_offload"] = True
        if self.lean_norm:
            out["lean_norm"] = True
        if self.cross_entropy == "fused_linear":
            out["cross_entropy"] = "fused_linear"
        return out


def plan_option(scn: Scenario, budget: Budget | None) -> PlanOption:
    """Memory and speed of one scenario as a plan option."""
    layers = model_shape(scn.model).num_layers
    est = estimate(scn)
    return PlanOption(
        micro_batch_size=scn.micro_batch_size,
        grad_accum_steps=scn.grad_accum_steps,
        checkpointed_layers=scn.checkpointed(layers),
        num_layers=layers,
        tensors_gib=est.tensors_gib,
        total_gib=est.total_gib,
        verdict=verdict(est.total_gib, budget) if budget else None,
        speed=predict_speed(scn, budget.gpu if budget else None),
        tiled_mlp=scn.tiled_mlp,
        activation_offload=scn.activation_offload,
        lean_norm=scn.lean_norm,
        cross_entropy=scn.cross_entropy,
    )


def fastest_options(
    scn: Scenario, per_rank: int, budget: Budget, micros: list[int] | None = None, layers: int | None = None
) -> list[PlanOption]:
    """For each micro-batch (`micros`, default every divisor of `per_rank`): the option with the fewest
    checkpointed layers that fits (or exactly `layers` checkpointed, when given), fastest first.

    Fewer checkpointed layers is always faster at a given micro-batch (less recomputation), and the peak
    only grows as layers stop being checkpointed, so the scan stops at the first fitting count.
    """
    num_layers = model_shape(scn.model).num_layers
    # Offload needs checkpointing: at least one checkpointed layer.
    counts = [layers] if layers is not None else list(range(int(scn.activation_offload), num_layers + 1))
    if model_shape(scn.model).is_vision and layers is None:
        # A vision-language run checkpoints the first n of its vision blocks + decoder layers, vision first
        # (`models.build.enable_memory_levers`): only none or all of them is a plan the model counts.
        counts = [c for c in (0, num_layers) if c >= int(scn.activation_offload)]
    options = []
    for m in micros if micros is not None else divisors(per_rank):
        at_micro = scn.with_micro(m, per_rank // m)
        for n in counts:
            option = plan_option(at_micro.with_checkpointing(n), budget)
            if option.verdict == "fits":
                options.append(option)
                break
    return sorted(options, key=lambda o: -o.speed.tokens_per_s)


def baseline_option(scn: Scenario, per_rank: int, budget: Budget) -> PlanOption | None:
    """Full checkpointing at the largest micro-batch that fits: what `auto` picked before selective
    checkpointing and the chunked loss (the reference for the predicted speed-up)."""
    full = scn.with_checkpointing(True)
    if scn.cross_entropy == "chunked":
        full = replace(full, cross_entropy="unchunked")
    fitting = fastest_options(full, per_rank, budget, layers=model_shape(scn.model).num_layers)
    return max(fitting, key=lambda o: o.micro_batch_size) if fitting else None


def lever_variants(cfg: ZerofitConfig, scn: Scenario) -> list[Scenario]:
    """`scn` with every combination of the `auto` levers' settings (`train.tiled_mlp`,
    `train.activation_offload`, `train.lean_norm`), the levers-off one first (ties keep it). Offload only
    where some layer can be checkpointed (`resolve()` refuses it otherwise)."""
    t = cfg.train
    shards = TILED_MLP_SHARDS if t.tiled_mlp == "auto" else (scn.tiled_mlp,)
    offload: tuple[bool, ...] = (scn.activation_offload,)
    if t.activation_offload == "auto":
        offload = (False, True) if t.activation_checkpointing not in (False, 0) else (False,)
    lean = (scn.lean_norm,)
    if t.lean_norm == "auto":
        from zerofit.planner.context import lean_norm_applies

        lean = (False, True) if lean_norm_applies(scn.model) else (False,)
    losses = (scn.cross_entropy,)
    if t.cross_entropy == "auto":
        from zerofit.planner.context import fused_loss_refusal

        losses = ("chunked",) if fused_loss_refusal(cfg) else ("chunked", "fused_linear")
    return [
        scn.with_levers(tiled_mlp=s, activation_offload=o, lean_norm=n, cross_entropy=c)
        for c in losses
        for n in lean
        for o in offload
        for s in shards
    ]
