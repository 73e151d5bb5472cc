"""bitsandbytes 8-bit optimizers over FSDP2's DTensor parameters: each rank steps its own shard.

bitsandbytes kernels are custom ops with no DTensor sharding rule, so stepping a `fully_shard`-ed
parameter fails ("... does not have a sharding strategy registered"). The update is element-wise and its
8-bit state is quantized in blocks of 256 elements, so it is exact to run it on each rank's local shard,
as ZeRO does with its flat partitions: the kernel gets plain local tensors, and the state stays in DTensors
so DCP checkpoints write every rank's part (a plain tensor would be treated as replicated and only one
rank's copy would be saved).

- `state1` / `state2` are DTensors laid out like the parameter (8-bit codes, or fp32 for small tensors);
- `absmax1` / `absmax2` (one scale per block of the local shard) are DTensors of global shape
  `(world * blocks,)`, sharded evenly: each rank owns `blocks` scales, sized for the largest shard;
- whether a tensor gets 8-bit state is decided on the parameter's global size (as without sharding), so
  every rank agrees and the checkpoint has one dtype per state.

The blocks are those of the local shard, so a checkpoint resumes on the same number of ranks only.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

_BLOCKSIZE = 256  # bitsandbytes' fixed block size for 8-bit optimizer state
_ABSMAX = ("absmax1", "absmax2")


def _largest_shard_numel(p: DTensor) -> int:
    """Elements of the largest local shard of `p` (torch.chunk semantics: the first shards are the big ones)."""
    shape = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            size = p.device_mesh.size(mesh_dim)
            shape[placement.dim] = -(-shape[placement.dim] // size)
    return math.prod(shape)


def _blocks(n: int) -> int:
    return -(-n // _BLOCKSIZE)


class _ShardedStep:
    """Mixin for a bitsandbytes `Optimizer8bit` subclass: DTensor parameters are stepped shard by shard."""

    state: Any

    def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if isinstance(p, DTensor):
            # A DTensor laid out like the parameter. (Paged buffers are plain tensors of the full shape,
            # so a sharded parameter's state is never paged.)
            return torch.zeros_like(p, dtype=dtype)
        return super().get_state_buffer(p, dtype)  # type: ignore[misc]

    @torch.no_grad()
    def init_state(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        super().init_state(group, p, gindex, pindex)  # type: ignore[misc]
        if not isinstance(p, DTensor):
            return
        if p.device_mesh.ndim != 1:
            raise NotImplementedError("8-bit optimizer state on DTensors supports a 1-D device mesh only")
        state = self.state[p]
        world = p.device_mesh.size()
        blocks = _blocks(_largest_shard_numel(p))
        for key in _ABSMAX:
            if key in state:  # sized by bitsandbytes for the whole parameter: replace by this rank's part
                local = torch.zeros(blocks, dtype=torch.float32, device=p.to_local().device)
                state[key] = DTensor.from_local(
                    local, p.device_mesh, [Shard(0)], run_check=False, shape=(world * blocks,), stride=(1,)
                )

    @torch.no_grad()
    def update_step(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        if not isinstance(p, DTensor):
            super().update_step(group, p, gindex, pindex)  # type: ignore[misc]
            return
        state = self.state[p]
        local = p.to_local()  # shares storage with the parameter: the kernel updates it in place
        if local.numel() == 0:  # an empty shard (fewer rows than ranks): nothing to update here
            state["step"] += 1
            return
        shard = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
        for key in _ABSMAX:
            if key in shard:
                shard[key] = shard[key][: _blocks(local.numel())]
        # The kernel call reads the state and the gradient through the parameter it is given.
        self.state[local] = shard
        local.grad = p.grad.to_local()
        try:
            super().update_step(group, local, gindex, pindex)  # type: ignore[misc]
        finally:
            local.grad = None
            del self.state[local]
        state["step"] = shard["step"]


@cache
def sharded(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`cls` (a bitsandbytes 8-bit optimizer class) able to step FSDP2's DTensor parameters."""
    return type(cls.__name__, (_ShardedStep, cls), {"__doc__": cls.__doc__, "__module__": __name__})
