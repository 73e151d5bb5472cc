"""Activation offload (`train.activation_offload`): checkpointed layers' saved inputs live in host memory.

Under non-reentrant `torch.utils.checkpoint` the only tensors a checkpointed decoder layer keeps from forward
to backward are its positional inputs (the hidden states entering the layer, saved through autograd's saved
tensors; everything inside the layer is recomputed). `ActivationOffload` is a pair of
`torch.autograd.graph.saved_tensors_hooks` entered around each checkpointed layer's checkpoint call, so it
sees exactly those tensors (the checkpoint's own hooks take over inside the layer):

- pack (forward): copy the tensor to pinned host memory on a side CUDA stream that waits for the compute
  stream; the device tensor is released as soon as the copy has run (`record_stream`), so forward keeps no
  checkpointed layer input on the GPU;
- unpack (backward, when the layer is recomputed): wait for the tensor's copy back and start copying the
  next one backward will need (the layer below: pack order reversed) on the side stream, so the transfer
  overlaps the recomputation and backward of this layer.

On a machine without CUDA the same hooks run with a plain host copy (no streams), which keeps the mechanism
testable on CPU. The values are bit-identical (a copy), so loss and gradients are the plain run's.

Memory: the GPU holds at most two offloaded tensors at a time (the one in use and the one prefetched);
host RAM holds every checkpointed layer's input for the step (checkpointed layers x tokens x hidden x
residual bytes, pinned); PCIe moves that twice per micro-step (down in forward, up in backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

__all__ = ["ActivationOffload", "describe_offload", "enable_activation_offload"]


def describe_offload(n_layers: int, enabled: bool) -> str:
    """For plans: what is offloaded, e.g. `inputs of the 12 checkpointed layers -> pinned host memory`."""
    if not enabled or n_layers <= 0:
        return "off"
    return f"inputs of the {n_layers} checkpointed layers -> pinned host memory"


class _Offloaded:
    """One saved tensor's host copy, and its device copy while one is prefetched or in flight."""

    def __init__(self, host: torch.Tensor, device: torch.device, copied: torch.cuda.Event | None) -> None:
        self.host = host
        self.device = device
        self.copied = copied  # the device -> host copy's event (CUDA only)
        self.prefetched: torch.Tensor | None = None
        self.arrived: torch.cuda.Event | None = None  # the host -> device prefetch's event


class ActivationOffload:
    """The pack / unpack hooks and their side stream, shared by the model's checkpointed layers.

    `offloaded_bytes` counts the bytes packed since the last `take_offloaded_bytes()` (per optimizer step
    when the loop takes it once per step).
    """

    def __init__(self) -> None:
        self.offloaded_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._order: list[weakref.ref[_Offloaded]] = []  # pack order of the tensors still saved

    def take_offloaded_bytes(self) -> int:
        """Bytes offloaded since the previous call (and reset the count)."""
        taken, self.offloaded_bytes = self.offloaded_bytes, 0
        return taken

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor) -> Any:
        """Forward: the tensor's host copy replaces it (parameters, which are kept anyway, stay as they are)."""
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        if not any(ref() is not None for ref in self._order):
            self._order = []  # a new forward: the previous one's tensors are all released
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type != "cuda":
            entry = _Offloaded(tensor.detach().to("cpu", copy=True), tensor.device, None)
        else:
            entry = self._pack_cuda(tensor)
        self._order.append(weakref.ref(entry))
        return entry

    def _pack_cuda(self, tensor: torch.Tensor) -> _Offloaded:
        stream = self._stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is complete first
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor.detach(), non_blocking=True)
            copied = stream.record_event()
        tensor.record_stream(stream)  # its memory is reused only after the copy has read it
        return _Offloaded(host, tensor.device, copied)

    def unpack(self, packed: Any) -> torch.Tensor:
        """Backward: the tensor back on its device; starts prefetching the one packed before it."""
        if isinstance(packed, torch.Tensor):
            return packed
        entry: _Offloaded = packed
        if entry.device.type != "cuda":
            return entry.host if entry.device.type == "cpu" else entry.host.to(entry.device)
        tensor = self._arrive(entry)
        self._prefetch_before(entry)
        return tensor

    def _arrive(self, entry: _Offloaded) -> torch.Tensor:
        """The entry's device copy, ordered before the compute stream's next use of it."""
        current = torch.cuda.current_stream(entry.device)
        if entry.prefetched is None:
            current.wait_event(entry.copied)  # type: ignore[arg-type]
            return entry.host.to(entry.device, non_blocking=True)
        current.wait_event(entry.arrived)  # type: ignore[arg-type]
        tensor, entry.prefetched = entry.prefetched, None
        tensor.record_stream(current)  # allocated on the side stream, used on the compute stream
        return tensor

    def _prefetch_before(self, entry: _Offloaded) -> None:
        """Copy the tensor packed just before `entry` (backward's next) to the device on the side stream."""
        index = next((i for i, ref in enumerate(self._order) if ref() is entry), 0)
        previous = self._order[index - 1]() if index > 0 else None
        if previous is None or previous.prefetched is not None:
            return
        stream = self._stream(previous.device)
        with torch.cuda.stream(stream):  # after its own device -> host copy: the same stream
            previous.prefetched = previous.host.to(previous.device, non_blocking=True)
            previous.arrived = stream.record_event()


def _offloaded_checkpoint(
    offload: ActivationOffload, checkpoint: Callable[..., Any], *args: Any, **kw: Any
) -> Any:
    """A layer's checkpoint call with the offload hooks around it (the checkpoint's saved inputs)."""
    with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
        return checkpoint(*args, **kw)


def enable_activation_offload(
    checkpointed: list[torch.nn.Module], offload: ActivationOffload | None = None
) -> ActivationOffload:
    """Offload the saved inputs of these checkpointed decoder layers (transformers' `GradientCheckpointingLayer`s
    whose checkpointing `enable_activation_checkpointing` turned on); returns the shared hooks (`offload`:
    hooks of one's own, e.g. the planner's trace, which offloads to the meta device)."""
    offload = offload if offload is not None else ActivationOffload()
    for layer in checkpointed:
        layer._gradient_checkpointing_func = partial(  # type: ignore[assignment]
            _offloaded_checkpoint, offload, layer._gradient_checkpointing_func
        )
    return offload
