"""A distillation teacher's memory (`train.objective: gkd`, `gkd.teacher`): what the frozen teacher adds to
each rank, counted by `estimate` in every phase of the step.

    teacher weights   every parameter, whole on each rank (no optimizer state, nothing to shard), in the
                      student's load dtype, or bitsandbytes' bytes for its linear weights (gkd.teacher_load_in)
    logits            the teacher's no-grad logits of one micro-batch and the student's whole-vocabulary
                      logits the divergence reads (2 x [micro, seq, vocab], fp32), beyond what the student's
                      chunked cross-entropy path counts, in training only

The teacher's shape is its config.json's: a built-in, a hub id or a model folder as named; a zerofit run
folder or adapter export has the shape of the base its config records (the adapters' few parameters are not
counted).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from zerofit.core.run_layout import CONFIG_FILE, EXPORT_INFO
from zerofit.planner.shapes import model_shape

__all__ = ["teacher_base", "teacher_lines"]

_FP32 = 4


def _recorded_model(config: object) -> str | None:
    """`model.name_or_path` of a recorded zerofit config mapping, or None."""
    model = config.get("model") if isinstance(config, dict) else None
    name = model.get("name_or_path") if isinstance(model, dict) else None
    return name if isinstance(name, str) else None


def teacher_base(teacher: str) -> str:
    """The model whose shape `teacher` has: a run folder's or an adapter export's recorded base, else itself."""
    folder = Path(teacher)
    try:
        if (folder / CONFIG_FILE).is_file():
            return _recorded_model(yaml.safe_load((folder / CONFIG_FILE).read_text())) or teacher
        if (folder / EXPORT_INFO).is_file() and not (folder / "config.json").is_file():
            info = json.loads((folder / EXPORT_INFO).read_text())
            return _recorded_model(info.get("config") if isinstance(info, dict) else None) or teacher
    except (OSError, ValueError, yaml.YAMLError):
        return teacher
    return teacher


def _weight_bytes(teacher: str, load_bytes: int, load_in: str) -> int:
    """The teacher's parameters in `load_bytes` each, its linear weights quantized under `load_in`."""
    shape = model_shape(teacher_base(teacher))
    if load_in == "none":
        return shape.total_params * load_bytes
    linear = shape.layer_linear_weight_params * shape.num_layers
    per_value = 1.0 if load_in == "8bit" else 0.5 + _FP32 / 64  # int8, or nf4 with an fp32 absmax per 64
    return math.ceil(linear * per_value) + (shape.total_params - linear) * load_bytes


def teacher_lines(
    teacher: str, load_in: str, load_bytes: int, micro: int, seq_len: int
) -> tuple[dict[str, int], dict[str, int]]:
    """(lines held in every phase, lines of the forward/backward phase) of the teacher, one rank."""
    shape = model_shape(teacher_base(teacher))
    weights = f"teacher: weights ({shape.total_params:,} params{', ' + load_in if load_in != 'none' else ''})"
    logits = (
        f"distillation: teacher and student logits (2 x {micro} x {seq_len} x {shape.vocab_size:,}, fp32)"
    )
    return (
        {weights: _weight_bytes(teacher, load_bytes, load_in)},
        {logits: 2 * micro * seq_len * shape.vocab_size * _FP32},
    )
