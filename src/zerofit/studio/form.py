"""The plan page's fields as the command line's words: a config file, `--world-size`, `--gpu` and dotted
overrides. No config logic lives here or in the page: a field only names the overrides a user would type, and
everything they mean is decided by `zerofit plan`'s own code (`planning.py`).

A field the user left at its config file's value adds no override, so the plan is the file's plan until a
field changes, as on the command line. A remedy's `how` (the planner's overrides, or a launch on more ranks)
is applied to the fields it names and kept as extra overrides otherwise. A problem of the CLI's paragraph is
shown beside the field whose key it names.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from zerofit.catalogue.presets import DEFAULT_PRESET, list_presets
from zerofit.config import load_config
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ConfigError

# method -> (lora.enabled, quantization.load_in)
METHODS: dict[str, tuple[str, str]] = {
    "full": ("false", "none"),
    "lora": ("true", "none"),
    "qlora": ("true", "4bit"),
}
ENGINES_WITHOUT_PRESET = ("single", "ddp")  # a `preset` choice that is a strategy with no preset file
_MORE_RANKS = re.compile(r"^launch (\d+) ranks")


@dataclass
class PlanForm:
    """The plan page's inputs, each one word of the command line (see the module docstring)."""

    config: str = "configs/demo.yaml"  # --config, relative to the workspace
    model: str = ""  # model.name_or_path
    gpu: str = ""  # --gpu (a catalogue name); "" = none
    num_gpus: int = 1  # --world-size
    objective: str = ""  # train.objective
    method: str = ""  # full | lora | qlora
    preset: str = ""  # distributed.preset, or an engine without one (single, ddp)
    seq_len: int = 0  # data.max_seq_len
    global_batch: int = 0  # batch.global_batch_size
    overrides: list[str] = field(default_factory=list)  # further dotted overrides, as typed

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanForm:
        """The form the page posted (unknown keys ignored, numbers as numbers)."""
        known = {f.name for f in fields(cls)}
        form = cls(**{k: v for k, v in data.items() if k in known})
        form.num_gpus = _whole(form.num_gpus, "number of GPUs (--world-size)", 1)
        form.seq_len = _whole(form.seq_len, "data.max_seq_len", 0)
        form.global_batch = _whole(form.global_batch, "batch.global_batch_size", 0)
        form.overrides = [str(o).strip() for o in form.overrides if str(o).strip()]
        return form

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)


def _whole(value: Any, what: str, empty: int) -> int:
    """A number field as an int (`empty` for a blank one); anything else is the one-paragraph refusal."""
    if value in (None, ""):
        return empty
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError([f"{what} = {value!r}: not a whole number; type one, e.g. 1024"]) from None


def form_of(config_file: str, cfg: ZerofitConfig) -> PlanForm:
    """The fields as config file `config_file` (loaded as `cfg`) sets them."""
    method = "full" if not cfg.lora.enabled else ("qlora" if cfg.quantization.load_in == "4bit" else "lora")
    strategy = cfg.distributed.strategy
    preset = cfg.distributed.preset or DEFAULT_PRESET.get(strategy) or strategy
    return PlanForm(
        config=config_file,
        model=cfg.model.name_or_path,
        gpu=cfg.planner.gpu or "",
        objective=cfg.train.objective,
        method=method,
        preset=preset,
        seq_len=cfg.data.max_seq_len,
        global_batch=int(cfg.batch.global_batch_size or 0),
    )


def field_overrides(form: PlanForm, base: PlanForm) -> list[str]:
    """The overrides of the fields that differ from the config file's own values, then the typed ones."""
    out = _changed(form, base, _KEYS_BEFORE)
    if form.method != base.method and form.method in METHODS:
        enabled, load_in = METHODS[form.method]
        out += [f"lora.enabled={enabled}", f"quantization.load_in={load_in}"]
    if form.preset != base.preset:
        out += _engine_overrides(form.preset)
    return out + _changed(form, base, _KEYS_AFTER) + form.overrides


# The fields that are one config key each, as `field -> dotted key`, before and after the method and preset.
_KEYS_BEFORE = (("model", "model.name_or_path"), ("objective", "train.objective"))
_KEYS_AFTER = (("seq_len", "data.max_seq_len"), ("global_batch", "batch.global_batch_size"))


def _changed(form: PlanForm, base: PlanForm, keys: tuple[tuple[str, str], ...]) -> list[str]:
    """`key=value` for each of `keys`' fields whose value differs from the config file's own."""
    return [
        f"{key}={getattr(form, field)}" for field, key in keys if getattr(form, field) != getattr(base, field)
    ]


def _engine_overrides(preset: str) -> list[str]:
    """`preset` as the engine overrides a user types: a preset names its strategy; single / ddp have none."""
    if preset in ENGINES_WITHOUT_PRESET:
        return [f"distributed.strategy={preset}", "distributed.preset=null"]
    found = list_presets().get(preset)
    strategy = found.strategy if found is not None else "deepspeed"  # an unknown name: the loader says so
    return [f"distributed.strategy={strategy}", f"distributed.preset={preset}"]


def apply_remedy(form: PlanForm, how: str) -> PlanForm:
    """`form` with remedy `how` applied: `launch N ranks ...` sets the GPUs, each `key=value` goes to the field
    that key belongs to (method, engine) or, replacing an earlier one of the same key, to the overrides."""
    more = _MORE_RANKS.match(how)
    words = [w for w in how.split() if "=" in w]
    values = dict(w.split("=", 1) for w in words)
    new = replace(
        form, overrides=list(form.overrides), num_gpus=int(more.group(1)) if more else form.num_gpus
    )
    lora, load_in = values.pop("lora.enabled", None), values.pop("quantization.load_in", None)
    if lora is not None or load_in is not None:
        enabled, quant = METHODS.get(form.method, METHODS["lora"])
        pair = (lora or enabled, load_in or quant)
        new.method = next((m for m, v in METHODS.items() if v == pair), form.method)
    strategy, preset = values.pop("distributed.strategy", None), values.pop("distributed.preset", None)
    if preset not in (None, "null"):
        new.preset = preset
    elif strategy is not None:
        new.preset = strategy
    for key, value in values.items():
        new.overrides = [o for o in new.overrides if o.split("=", 1)[0] != key] + [f"{key}={value}"]
    return new


# The form field each config key belongs to, longest first so `planner.gpu_memory_gib` is not `planner.gpu`.
_FIELD_KEYS: tuple[tuple[str, str], ...] = (
    ("model.name_or_path", "model"),
    ("train.objective", "objective"),
    ("lora.", "method"),
    ("quantization.", "method"),
    ("distributed.", "preset"),
    ("data.max_seq_len", "seq_len"),
    ("batch.global_batch_size", "global_batch"),
    ("planner.gpu", "gpu"),
    ("--gpu", "gpu"),
    ("world size", "num_gpus"),
    ("--world-size", "num_gpus"),
    ("dp_size", "num_gpus"),
    ("config file", "config"),
    ("config = ", "config"),  # the workspace's refusals of the config and the model picked
    ("model = ", "model"),
)


def field_of(problem: str) -> str:
    """The form field a problem of the CLI's paragraph names first, or `overrides` (shown above the form)."""
    hits = [(problem.find(key), name) for key, name in _FIELD_KEYS if key in problem]
    return min(hits)[1] if hits else "overrides"


@dataclass(frozen=True)
class CommandLine:
    """A form as `zerofit plan`'s arguments: the world size, `--gpu` (only where it changed the file's
    planner.gpu) and the overrides, in the order a user would type them."""

    config: str
    world_size: int
    gpu: str | None
    overrides: list[str]

    @classmethod
    def of(cls, form: PlanForm, base: PlanForm) -> CommandLine:
        """The arguments of `form` over its config file's own fields `base`."""
        overrides = field_overrides(form, base)
        gpu = form.gpu or None if form.gpu != base.gpu else None
        if form.gpu != base.gpu and not form.gpu:
            overrides.append("planner.gpu=null")
        return cls(form.config, form.num_gpus, gpu, overrides)

    def lines(self) -> dict[str, str]:
        """The terminal commands: `zerofit plan` of this form, and the launch of the same run with the launcher
        the studio's own Launch uses (`studio.launches.launch_prefix`: python for one rank, torchrun for
        several, whatever the engine: every launcher runs every engine, docs/contracts.md)."""
        plan = ["zerofit", "plan", "--config", self.config, "--world-size", str(self.world_size)]
        plan += ["--gpu", self.gpu] if self.gpu else []
        n = self.world_size
        launcher = ["python"] if n == 1 else ["torchrun", "--nproc_per_node", str(n)]
        launch = [*launcher, "launchers/launch_finetune.py", "--config", self.config]
        return {"plan": shlex.join(plan + self.overrides), "launch": shlex.join(launch + self.overrides)}


def base_form(config_file: str) -> PlanForm:
    """The fields as the config file sets them (a missing or invalid file: the loader's ConfigError)."""
    return form_of(config_file, load_config(config_file))
