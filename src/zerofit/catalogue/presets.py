"""Engine presets: partial DeepSpeed / FSDP2 overlays shipped in `ds_configs/`.

A preset file is JSON with a `_zerofit` block (`strategy`, one-line `description`) and the engine keys it
fixes. Presets carry no batch keys and no `"auto"`: the batch triple and everything derived from the model
are filled by the renderer from a resolved config, so a preset can never disagree with the batch plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError

# The preset a strategy uses when `distributed.preset` is not set; None = the strategy takes no preset.
DEFAULT_PRESET: dict[str, str | None] = {"deepspeed": "zero2", "fsdp": "fsdp", "single": None, "ddp": None}


@dataclass(frozen=True)
class Preset:
    """One preset file: its name (file stem), engine, description and the engine keys it fixes."""

    name: str
    strategy: str
    description: str
    path: Path
    body: dict[str, Any] = field(repr=False)


def presets_dir() -> Path:
    """Where the presets live: inside the installed wheel, else the checkout's `ds_configs/`."""
    packaged = Path(str(resources.files("zerofit"))) / "ds_configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "ds_configs"


def _read_preset(path: Path) -> Preset:
    data = json.loads(path.read_text())
    meta = data.pop("_zerofit", {})
    return Preset(
        name=path.stem,
        strategy=str(meta.get("strategy", "deepspeed")),
        description=str(meta.get("description", "")),
        path=path,
        body=data,
    )


@cache
def list_presets() -> dict[str, Preset]:
    """All shipped presets by name, sorted."""
    return {p.stem: _read_preset(p) for p in sorted(presets_dir().glob("*.json"))}


def get_preset(name: str) -> Preset:
    """The preset called `name`, or a `ConfigError` listing the presets that exist."""
    presets = list_presets()
    if name not in presets:
        listing = ", ".join(f"{n} ({p.strategy})" for n, p in presets.items())
        raise ConfigError([f"distributed.preset = {name!r} is not a known preset; available: {listing}"])
    return presets[name]
