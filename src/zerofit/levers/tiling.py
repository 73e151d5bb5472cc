"""Tiled MLP (`train.tiled_mlp`): each decoder layer's MLP runs over shards of its tokens, forward and backward.

At long context a layer's MLP intermediates (gate, up, act(gate) * up: tokens x intermediate each, 3.5x the
hidden size on Llama) dwarf its input. `_TiledMLP` (the Arctic long-sequence recipe's TiledMLP, written for
zerofit) runs the MLP shard by shard under `no_grad` in forward, keeping only its input; backward recomputes
one shard at a time with grad and sums the input and parameter gradients. So the intermediates exist for one
shard at a time, in forward and backward (and in a checkpointed layer's recomputation, which reruns it).

Exact: the MLP is per token, so shards of the (flattened) token axis give the plain MLP's output and
gradients, packed rows included; only the matmuls' row blocking (rounding) differs. Dropout inside the MLP
(LoRA dropout) replays the forward's RNG state per shard in backward, so recompute and forward agree; the
masks are drawn per shard, so with dropout > 0 they are other draws than an untiled run's (same distribution).

Engines: the MLP's trainable parameters are inputs of the autograd function and their gradients are
returned once per backward (computed with `torch.autograd.grad` per shard, summed), so each parameter's
gradient is accumulated once per micro-step, as the engines' gradient hooks expect (DDP's reducer, ZeRO-1/2
buckets, FSDP2's post-backward reduce-scatter of the layer). DeepSpeed's own
`deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP` instead calls `torch.autograd.backward` once per
shard and relies on ZeRO's `ds_grad_is_ready` flag to skip all but the last accumulation: under DDP that
marks a parameter ready once per shard (refused by its reducer), so it is not used here. Under ZeRO-3 the MLP
is marked a ZeRO-3 leaf module (`_z3_leaf`): its parameters are gathered when the MLP is called, before the
function sees them, and reduced after its backward.

Cost: one more MLP forward per layer and step (the backward's recompute); under activation checkpointing the
layer's recompute also reruns the sharded forward (3 MLP forwards in all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from zerofit.core.errors import ConfigError

__all__ = ["describe_tiling", "enable_tiled_mlp", "tiled_mlp_shards"]


def tiled_mlp_shards(setting: bool | int | str) -> int:
    """Shards of a `train.tiled_mlp` value: 0 when off. `auto` must have been resolved by the planner."""
    if setting is False:
        return 0
    if isinstance(setting, int) and not isinstance(setting, bool):
        return setting
    raise ConfigError(
        [
            f"train.tiled_mlp = {setting!r} reached the model unresolved: the planner decides it in resolve() "
            "(zerofit plan / a launch); outside them it must be false or a number of sequence shards; e.g. train.tiled_mlp=4 (the MLP intermediates then exist for a quarter "
            "of the tokens at a time), or train.tiled_mlp=false."
        ]
    )


def describe_tiling(shards: int) -> str:
    """`MLP in 4 token shards` or `off`, for plans and tables."""
    return f"MLP in {shards} token shards" if shards > 0 else "off"


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, for a CUDA tensor, its device's (what dropout draws from)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def _replayed_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> Iterator[None]:
    """Run with the generators set to `state`, then restore them (the backward's own RNG is untouched)."""
    with torch.random.fork_rng(devices=[device] if state[1] is not None else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _autocast_state(device: torch.device) -> tuple[str, torch.dtype | None]:
    """The autocast the forward runs under (device type, dtype or None when off), replayed in backward."""
    kind = device.type
    on = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    return kind, torch.get_autocast_dtype(kind) if on else None


def _autocast(state: tuple[str, torch.dtype | None]) -> AbstractContextManager[Any]:
    """Autocast as the forward had it (backward runs outside the forward's autocast region)."""
    kind, dtype = state
    return torch.autocast(kind, dtype=dtype) if dtype is not None else nullcontext()


class _TiledMLP(torch.autograd.Function):
    """`mlp_forward(x)` over `shards` slices of x's flattened tokens; gradients for x and `params`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        mlp_forward: Callable[[torch.Tensor], torch.Tensor],
        shards: int,
        x: torch.Tensor,
        *params: Any,
    ) -> torch.Tensor:
        # Detached: views of x made under no_grad would still say requires_grad without a grad_fn, which
        # module hooks (torch's ModTracker / MemTracker, the planner's trace) cannot follow.
        flat = x.detach().reshape(-1, x.shape[-1])
        pieces = flat.tensor_split(shards)
        ctx.mlp_forward, ctx.shards, ctx.params = mlp_forward, shards, params
        ctx.rng = []
        ctx.autocast = _autocast_state(x.device)
        out: torch.Tensor | None = None
        start = 0
        with torch.no_grad():
            for piece in pieces:
                ctx.rng.append(_rng_state(x.device))
                y = mlp_forward(piece)
                if out is None:  # one output buffer, written shard by shard (no list + cat copy)
                    out = y.new_empty((flat.shape[0], y.shape[-1]))
                out[start : start + piece.shape[0]] = y
                start += piece.shape[0]
        ctx.save_for_backward(x)
        assert out is not None, "tensor_split always yields at least one piece"
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        needs_x = bool(ctx.needs_input_grad[2])
        params = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[3:], strict=True) if needed]
        flat = x.detach().reshape(-1, x.shape[-1])
        grads_out = grad_out.reshape(-1, grad_out.shape[-1]).tensor_split(ctx.shards)
        grad_x = torch.empty_like(flat) if needs_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        start = 0
        for index, (piece, g) in enumerate(zip(flat.tensor_split(ctx.shards), grads_out, strict=True)):
            piece = piece.detach().requires_grad_(needs_x)
            with torch.enable_grad(), _replayed_rng(ctx.rng[index], x.device), _autocast(ctx.autocast):
                y = ctx.mlp_forward(piece)
            inputs = [piece, *params] if needs_x else params
            grads = torch.autograd.grad(y, inputs, g, allow_unused=True)
            if needs_x:
                grad_x[start : start + piece.shape[0]] = grads[0]  # type: ignore[index]
                grads = grads[1:]
            for k, grad in enumerate(grads):
                if grad is not None:
                    sums[k] = grad if sums[k] is None else sums[k].add_(grad)  # type: ignore[union-attr]
            start += piece.shape[0]
        delivered = iter(sums)
        param_grads = [next(delivered) if needed else None for needed in ctx.needs_input_grad[3:]]
        dx = grad_x.view_as(x) if grad_x is not None else None
        return (None, None, dx, *param_grads)


def _tiled_forward(
    mlp: torch.nn.Module, plain: Callable[..., torch.Tensor], shards: int, x: torch.Tensor
) -> Any:
    """The MLP's forward, tiled: its trainable parameters at call time become the function's inputs (under
    FSDP2 and ZeRO-3 these are the gathered tensors the MLP computes with)."""
    params = [p for p in mlp.parameters() if p.requires_grad]
    return _TiledMLP.apply(plain, shards, x, *params)


def enable_tiled_mlp(decoder_layers: list[torch.nn.Module], shards: int) -> int:
    """Tile the `mlp` of every decoder layer in `shards` token shards; returns how many MLPs are tiled.

    The MLP module itself is kept (names, hooks, LoRA adapters unchanged): only its `forward` is replaced on
    the instance, so module hooks (ZeRO-3's gathering) still run around the tiled call.
    """
    if shards <= 0:
        return 0
    for layer in decoder_layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, torch.nn.Module):
            raise ConfigError(
                [
                    f"train.tiled_mlp = {shards}: decoder layer {type(layer).__name__} has no `mlp` module to tile "
                    "(a mixture-of-experts or custom architecture); set train.tiled_mlp=false for this model."
                ]
            )
        plain = mlp.forward
        mlp.forward = lambda x, _m=mlp, _f=plain: _tiled_forward(_m, _f, shards, x)  # type: ignore[method-assign]
        # ZeRO-3: gather all of the MLP's parameters when it is called (not per projection inside it), so the
        # function receives full tensors; ignored by every other engine.
        mlp._z3_leaf = True
    return len(decoder_layers)
