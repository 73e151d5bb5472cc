"""Config rules of the data: its sources exist (a local file, or a hub dataset id), the evaluation data is asked
for one way, and a chat template is a template."""

from __future__ import annotations

import os
import re
from pathlib import Path

from zerofit.config.schema import ZerofitConfig
from zerofit.core.data_files import DATA_FILE_SUFFIXES  # a path with one of them names a local file

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(path: str) -> bool:
    """True for `org/name` or `name` that is no data-file name: `data.path` is then a hub dataset id.

    Only consulted for paths that do not exist locally, so `data/missing.jsonl` stays a missing file.
    """
    return bool(_HUB_ID.match(path)) and not path.lower().endswith(DATA_FILE_SUFFIXES)


def _check_data_path(problems: list[str], key: str, path: str) -> None:
    """A local file or folder that exists, or a hub dataset id (checked when the data loads)."""
    if not Path(path).expanduser().exists() and not looks_like_hub_id(path):
        problems.append(
            f"{key} = {path!r}: file does not exist (relative paths are from {os.getcwd()}); give a data file "
            f"({', '.join(DATA_FILE_SUFFIXES)}), a `datasets` save_to_disk folder or a hub dataset id (org/name)"
        )


def check_data(problems: list[str], cfg: ZerofitConfig) -> None:
    """Data sources exist, the evaluation data is asked for one way only, and evaluations have data."""
    d = cfg.data
    _check_data_path(problems, "data.path", d.path)
    if d.eval_path is not None:
        _check_data_path(problems, "data.eval_path", d.eval_path)
    split = d.eval_split
    if isinstance(split, float) and d.eval_path is not None:
        problems.append(
            f"data.eval_split = {split} holds out part of data.path, but data.eval_path = {d.eval_path!r} is "
            "set too; use one of them (data.eval_split may name the split of data.eval_path instead)"
        )
    if isinstance(split, str):
        key, target = ("data.eval_path", d.eval_path) if d.eval_path is not None else ("data.path", d.path)
        if Path(target).expanduser().is_file():
            problems.append(
                f"data.eval_split = {split!r} names a split, but {key} = {target!r} is a file, which has no "
                "splits; hold out a fraction (data.eval_split=0.02) or set data.eval_path to the eval file"
            )
    if cfg.eval.every_steps > 0 and d.eval_path is None and split is None:
        problems.append(
            f"eval.every_steps = {cfg.eval.every_steps} but there is no evaluation data; set data.eval_path "
            "or data.eval_split (e.g. data.eval_split=0.02), or eval.every_steps=0"
        )
    template = d.chat_template
    if template is not None and "{" not in template and not Path(template).expanduser().is_file():
        problems.append(
            f"data.chat_template = {template!r}: neither a file nor a Jinja template; give the template "
            "text or the path of a .jinja file"
        )
