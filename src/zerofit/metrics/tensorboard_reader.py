"""Read a run's TensorBoard event files back as metrics rows, with TensorBoard's own reader.

For `zerofit compare` on a folder that has TensorBoard's files but no `metrics.jsonl` (a run folder whose
`tensorboard/` is all that was copied, or that folder itself). TensorBoard's `EventAccumulator` reads every
event file of the directory in order and drops what a resume's `purge_step` superseded, so each step comes
back once, as `tensorboard` shows it. Scalars become the row's numbers (float32, as TensorBoard stores them;
whole numbers as ints), text tags its labels (`mem/source`), and the text `config` (`tensorboard_sink`) the
run's config. Event files are data: they are parsed, never run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerofit.core.run_layout import TENSORBOARD_DIR
from zerofit.metrics.tensorboard_sink import CONFIG_TAG, config_of_text

EVENT_FILE_GLOB = "events.out.tfevents.*"
# The suffix torch's SummaryWriter gives a text tag (`add_text("config", ...)` is `config/text_summary`).
TEXT_SUFFIX = "/text_summary"


def event_dir(path: Path) -> Path | None:
    """The folder of TensorBoard event files `path` names: itself, or its `tensorboard/` (None: neither)."""
    for folder in (path, path / TENSORBOARD_DIR):
        if folder.is_dir() and any(folder.glob(EVENT_FILE_GLOB)):
            return folder
    return None


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def read_tensorboard_run(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows (one per step >= 1, in step order) and the logged config of the event files in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        TENSORS,
        EventAccumulator,
    )

    accumulator = EventAccumulator(str(folder), size_guidance={SCALARS: 0, TENSORS: 0})  # 0: keep every event
    accumulator.Reload()
    rows: dict[int, dict[str, Any]] = {}
    tags = accumulator.Tags()
    for tag in tags.get("scalars", []):
        for event in accumulator.Scalars(tag):
            if event.step >= 1:
                rows.setdefault(event.step, {"step": event.step})[tag] = _number(event.value)
    config: dict[str, Any] = {}
    for tag in tags.get("tensors", []):
        name = tag.removesuffix(TEXT_SUFFIX)
        for event in accumulator.Tensors(tag):
            values = event.tensor_proto.string_val
            text = values[0].decode("utf-8", "replace") if values else ""
            if name == CONFIG_TAG:
                config = config_of_text(text) or config  # a resume's (later) config wins
            elif event.step >= 1:
                rows.setdefault(event.step, {"step": event.step})[name] = text
    return [rows[step] for step in sorted(rows)], config
