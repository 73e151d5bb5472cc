"""The TensorBoard sink (`logging.tensorboard`): the rows of `metrics.jsonl` as TensorBoard scalars.

- Event files go to `run_dir/tensorboard/` (`tensorboard --logdir runs/` shows every run of `output_dir` side
  by side). Every numeric key of a row is a scalar of the same name at the row's optimizer step, whatever the
  key (the objective's metrics, every rank's memory, eval and harness scores): no fixed list. A label (such as
  `mem/source`) is a text summary, written when it changes.
- The resolved config is the run's hyper-parameters (TensorBoard's HParams tab) and the text `config` (the
  config as JSON, which `zerofit compare` reads back: `tensorboard_reader`).
- A resume writes a new event file into the same directory, opened with `purge_step` = the first step it logs:
  TensorBoard's readers drop what earlier files logged from that step on (the steps a killed launch logged
  after its checkpoint), so the run shows each step once, as trained last, like `metrics.jsonl` (rewound).
- Each log is flushed: a killed launch leaves every logged step on disk.
"""

from __future__ import annotations

import json
from typing import Any

from zerofit.config.loader import flatten
from zerofit.core.run_layout import RunLayout
from zerofit.metrics.base import NOT_NUMERIC, plottable
from zerofit.metrics.keys import EVAL_LOSS, LOSS

# The text tag holding the resolved config as JSON (in a Markdown code block, as TensorBoard shows text).
CONFIG_TAG = "config"
# The metrics the HParams tab lists beside the hyper-parameters.
HPARAM_METRICS = (LOSS, EVAL_LOSS)


def config_text(config: dict[str, Any]) -> str:
    """`config` as the Markdown TensorBoard's text tab shows: a JSON code block (`config_of_text` reads it)."""
    return "```json\n" + json.dumps(config, indent=2, default=str) + "\n```"


def config_of_text(text: str) -> dict[str, Any]:
    """The config `config_text` wrote (an empty dict for any other text: a folder from elsewhere)."""
    body = text.strip().removeprefix("```json").removesuffix("```")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def hparam_value(value: Any) -> int | float | str | bool:
    """A config value as TensorBoard's HParams plugin takes it: numbers and bools as they are, else text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str)


class TensorBoardSink:
    """Writes a run's rows and config into `run_dir/tensorboard/`; see the module docstring for the rules."""

    def __init__(self, run_dir: Any, first_step: int) -> None:
        """`first_step`: the first optimizer step this launch logs (1, or a resume's checkpoint step + 1)."""
        from torch.utils.tensorboard import SummaryWriter

        self.dir = RunLayout(run_dir).tensorboard
        self.first_step = first_step
        self.writer: Any = SummaryWriter(log_dir=str(self.dir), purge_step=first_step)
        self._labels: dict[str, str] = {}

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            if key == "step":
                continue
            converted = plottable(value)
            if converted is NOT_NUMERIC:
                if self._labels.get(key) != str(value):
                    self._labels[key] = str(value)
                    self.writer.add_text(key, str(value), step)
            elif converted is not None:
                self.writer.add_scalar(key, converted, step)
        self.writer.flush()

    def log_config(self, config: dict[str, Any]) -> None:
        """The config as hyper-parameters and as the text `config`, at step 0 of a new run (a resume's at its
        first step: the config it trains with from there, `checkpoint.allow_changes` included)."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        step = 0 if self.first_step <= 1 else self.first_step
        flat = {key: hparam_value(value) for key, value in flatten(config).items() if value is not None}
        file_writer = self.writer._get_file_writer()
        for summary in hparams(flat, dict.fromkeys(HPARAM_METRICS, 0.0)):
            file_writer.add_summary(summary, step)
        self.writer.add_text(CONFIG_TAG, config_text(config), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()
