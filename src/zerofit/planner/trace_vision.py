"""The images of a traced step (`trace.py`) for a Qwen-VL vision-language model: pixel values, the patch grid and
the M-RoPE positions, fed to the model under FakeTensorMode.

Fake tensors have no values, and the vision tower's bookkeeping is data-dependent (the grid's `.tolist()`, the
window index, `repeat_interleave` of the per-image lengths): transformers computes those in standalone
functions (`transformers.vision_utils`), which are run here once on the real grid, outside the fake mode, and
handed back to the tower as it calls them. What is traced is unchanged: every block, the projector and the
language model run on fake tensors of the real shapes. Three choices keep the bookkeeping static:
  - the micro-batch's image tokens are traced as one image of as many tokens (the tower's and projector's
    tensors are per patch, so their bytes are the same; attention runs per image either way);
  - the traced blocks attend the whole image (`fullatt_block_indexes`), not windows: a block's saved
    q/k/v/output are per patch whatever its windows, and the per-window split would need the windows'
    lengths as values;
  - the language model gets explicit 3-D positions (M-RoPE: time, height, width) of the real shape.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

from zerofit.planner.images import vision_dims


def traced_grid(scn: Any) -> Any:
    """The one traced image's patch grid (t, h, w): as close to square as its token count allows."""
    import torch

    dims = vision_dims(scn.model)
    merge = math.isqrt(dims.patches_per_token)
    tokens = scn.image_tokens
    rows = max(1, math.isqrt(tokens))
    return torch.tensor([[1, merge * rows, merge * (tokens // rows)]])


@contextlib.contextmanager
def traced_images(model: Any, scn: Any, mode: Any, micro: int, seq: int) -> Iterator[dict[str, Any]]:
    """Inside `mode` (a FakeTensorMode): the image inputs of the planned micro-batch for `model`'s forward,
    with the tower's data-dependent bookkeeping precomputed on the real grid (nothing for a language model
    or a micro-batch without images)."""
    import torch

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    visual = getattr(getattr(hf, "model", None), "visual", None)
    if visual is None or not scn.image_tokens:
        yield {}
        return
    import transformers.vision_utils as vu

    vc = visual.config
    merge = int(vc.spatial_merge_size)
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # real tensors: their values are read
        grid = traced_grid(scn)
        patches = int(grid.prod())
        positions = vu.get_vision_position_ids(grid, merge)
        seqlens = vu.get_vision_attention_seqlens(grid, vc)
        windows = (  # Qwen2.5-VL's windows (Qwen2-VL attends whole images)
            vu.get_vision_window_index(
                grid, spatial_merge_size=merge, window_size=vc.window_size, patch_size=vc.patch_size
            )
            if hasattr(vc, "window_size")
            else None
        )
    const = mode.fake_tensor_converter.from_real_tensor
    seqlens = (const(mode, seqlens[0], make_constant=True), seqlens[1])
    image_token = int(hf.config.image_token_id)

    def placeholder(input_ids: Any, inputs_embeds: Any, **kwargs: Any) -> tuple[Any, Any]:
        return (input_ids == image_token).unsqueeze(-1).expand_as(inputs_embeds), None

    module = sys.modules[type(visual).__module__]
    with contextlib.ExitStack() as stack:
        if windows is not None:  # Qwen2.5-VL: every traced block attends the whole image
            every = list(range(len(visual.blocks)))
            stack.enter_context(mock.patch.object(visual, "fullatt_block_indexes", every))
        stack.enter_context(mock.patch.object(hf.model, "get_placeholder_mask", placeholder))
        stack.enter_context(mock.patch.object(module, "get_vision_position_ids", lambda *a, **k: positions))
        stack.enter_context(
            mock.patch.object(module, "get_vision_attention_seqlens", lambda *a, **k: seqlens)
        )
        if windows is not None:
            stack.enter_context(mock.patch.object(module, "get_vision_window_index", lambda *a, **k: windows))
        yield {
            "pixel_values": torch.zeros(patches, vision_dims(scn.model).patch_width),
            "image_grid_thw": const(mode, grid, make_constant=True),
            "position_ids": torch.zeros(3, micro, seq, dtype=torch.long),
        }
