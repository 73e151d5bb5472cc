"""A user's own DeepSpeed JSON (`distributed.ds_config`): fill HF-style `"auto"`, refuse conflicts early.

Users arrive with DeepSpeed files written for the Hugging Face Trainer, full of `"auto"`. zerofit accepts
every `"auto"` the Trainer accepts and fills it from the resolved config (the batch triple from the plan,
clipping, precision, optimizer and scheduler hyper-parameters, bucket sizes from the model width). A value
the file hard-codes must agree with zerofit's; a disagreement is refused at plan time, before any model is
loaded, with both values and the fix, instead of DeepSpeed's `train_batch_size is not equal to ...`
assertion at launch or a silently different run. A `scheduler` block is honoured (DeepSpeed runs that
schedule, and the plan says so) or, when DeepSpeed does not know its type, refused.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerofit.core.errors import ConfigError
from zerofit.engine_spec.deepspeed_keys import DEEPSPEED_SCHEDULERS, hidden_size_buckets, model_hidden_size

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.resolution import ResolvedConfig

__all__ = ["filled_user_ds_config", "load_user_ds_config", "pinned_split_problems"]

AUTO = "auto"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# The split's DeepSpeed keys and the zerofit key that owns each.
_SPLIT_KEYS = {
    "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
    "gradient_accumulation_steps": "batch.grad_accum_steps",
}

# `"auto"` keys sized from the model width (filled as the HF Trainer does; never checked: a hard-coded
# bucket size is a performance choice, not a disagreement).
_HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


@dataclass(frozen=True)
class _Slot:
    """A DeepSpeed key zerofit can fill: its value, and the zerofit key that owns it (None = fill only)."""

    value: Any
    zerofit_key: str | None


def load_user_ds_config(path: str | Path) -> dict[str, Any]:
    """Read a DeepSpeed JSON file; a missing, unreadable or non-object file is a `ConfigError`."""
    file = Path(path)
    where = f"distributed.ds_config = {str(file)!r}"
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError([f"{where}: cannot read the file ({exc.strerror or exc})"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"{where} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"]
        ) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{where} must hold a JSON object of DeepSpeed keys, got {type(data).__name__}"])
    return data


def _slots(resolved: ResolvedConfig) -> dict[str, _Slot]:
    """Every non-model-derived key the HF Trainer allows as `"auto"`, with zerofit's value for it."""
    cfg, plan = resolved.config, resolved.batch
    opt, lr = cfg.optimizer, resolved.effective_lr
    return {
        "train_batch_size": _Slot(plan.global_batch_size, "batch.global_batch_size"),
        "train_micro_batch_size_per_gpu": _Slot(
            plan.micro_batch_size, _SPLIT_KEYS["train_micro_batch_size_per_gpu"]
        ),
        "gradient_accumulation_steps": _Slot(
            plan.grad_accum_steps, _SPLIT_KEYS["gradient_accumulation_steps"]
        ),
        "gradient_clipping": _Slot(float(cfg.train.max_grad_norm or 0.0), "train.max_grad_norm"),
        # Precision is checked separately (one message for the pair); these only fill `auto`.
        "fp16.enabled": _Slot(cfg.train.precision == "fp16", None),
        "bf16.enabled": _Slot(cfg.train.precision == "bf16", None),
        "optimizer.params.lr": _Slot(lr, "optimizer.lr"),
        "optimizer.params.betas": _Slot(list(opt.betas), "optimizer.betas"),
        "optimizer.params.eps": _Slot(opt.eps, "optimizer.eps"),
        "optimizer.params.weight_decay": _Slot(opt.weight_decay, "optimizer.weight_decay"),
        "scheduler.params.warmup_min_lr": _Slot(0.0, None),
        "scheduler.params.warmup_max_lr": _Slot(lr, "optimizer.lr"),
        # DeepSpeed >= 0.19.6 rejects 0 warmup steps; the HF Trainer fills max(1, warmup) as well.
        "scheduler.params.warmup_num_steps": _Slot(
            max(1, cfg.scheduler.warmup_steps), "scheduler.warmup_steps"
        ),
        "scheduler.params.total_num_steps": _Slot(cfg.train.max_steps, "train.max_steps"),
        # WarmupCosineLR's floors, as fractions of the peak.
        "scheduler.params.warmup_min_ratio": _Slot(0.0, None),
        "scheduler.params.cos_min_ratio": _Slot(cfg.scheduler.min_lr_ratio, "scheduler.min_lr_ratio"),
    }


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, container, key-or-index) for every leaf of a JSON tree."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict | list):
            yield from _leaves(value, dotted)
        else:
            yield dotted, node, key


def _get(body: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = body
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _same(a: Any, b: Any) -> bool:
    """Equal as config values: 1 == 1.0, [0.9, 0.999] == (0.9, 0.999), True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _override(key: str, value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    return f"{key}={value}"


def pinned_split_problems(cfg: ZerofitConfig) -> list[str]:
    """With `batch.micro_batch_size = auto`, the split keys the user's DeepSpeed file hard-codes (the
    planner chooses the split, so the file may not pin it), one problem each; a file that does not load
    gives its own problem. Asked by the planner before it weighs any candidate split."""
    path = cfg.distributed.ds_config
    if path is None or cfg.batch.micro_batch_size != AUTO:
        return []
    try:
        body = load_user_ds_config(path)
    except ConfigError as exc:
        return exc.problems
    problems = []
    for dotted, key in _SPLIT_KEYS.items():
        present, value = _get(body, dotted)
        if present and value != AUTO:
            problems.append(
                f"distributed.ds_config = {path!r} hard-codes {dotted} = {value!r}, but "
                f"batch.micro_batch_size = 'auto' lets the planner choose the split. Fix: set "
                f'"{dotted}": "auto" in the file (or delete it), or set {_override(key, value)} instead of auto'
            )
    return problems


def _hard_coded_problems(
    body: dict[str, Any], slots: dict[str, _Slot], resolved: ResolvedConfig, where: str
) -> list[str]:
    """Every value the file hard-codes that differs from zerofit's own for that key (an `auto` or a key
    zerofit does not own is no conflict), each with the fix: `auto` in the file, or the matching override."""
    plan = resolved.batch
    problems: list[str] = []
    for dotted, slot in slots.items():
        present, value = _get(body, dotted)
        if not present or value == AUTO or slot.zerofit_key is None:
            continue
        if _same(value, slot.value):
            continue
        if dotted in _BATCH_KEYS:
            context = f"the batch plan is {plan.describe()} at world size {resolved.world_size}"
            caveat = " (the batch split must still be exact)"
        else:
            context, caveat = f"zerofit's {slot.zerofit_key} gives {slot.value!r}", ""
        problems.append(
            f"{where} hard-codes {dotted} = {value!r}, but {context}, which needs {dotted} = {slot.value!r}. "
            f'Fix: set "{dotted}": "auto" in the file (or delete it) so zerofit writes its value, or set '
            f"{_override(slot.zerofit_key, value)} so both agree{caveat}"
        )
    return problems


def _fill_autos(body: dict[str, Any], slots: dict[str, _Slot], model: str, where: str) -> list[str]:
    """Fill every `auto` of `body` in place from zerofit's values (the slots, the hidden-size buckets of
    `model`); the problems: an `auto` zerofit has no value for, or a model whose hidden size is unknown."""
    problems: list[str] = []
    hidden_buckets: dict[str, int] | None = None
    for dotted, container, key in list(_leaves(body)):
        if container[key] != AUTO:
            continue
        if dotted in slots:
            container[key] = copy.deepcopy(slots[dotted].value)
        elif dotted in _HIDDEN_SIZE_KEYS:
            if hidden_buckets is None:
                try:
                    hidden_buckets = hidden_size_buckets(model_hidden_size(model), stage=3)
                except ConfigError as exc:
                    problems.extend(exc.problems)
                    hidden_buckets = {}
            if dotted.split(".")[-1] in hidden_buckets:
                container[key] = hidden_buckets[dotted.split(".")[-1]]
        else:
            fillable = ", ".join([*slots, *_HIDDEN_SIZE_KEYS])
            problems.append(
                f'{where} sets {dotted} = "auto", but zerofit has no value to fill it with (it fills: '
                f"{fillable}); write a concrete value there"
            )
    return problems


def _fill(resolved: ResolvedConfig) -> tuple[dict[str, Any], list[str]]:
    """The foreign file with every `auto` filled, and every problem found (empty when consistent)."""
    path = resolved.config.distributed.ds_config
    if path is None:
        return {}, []
    try:
        body = copy.deepcopy(load_user_ds_config(path))
    except ConfigError as exc:
        return {}, exc.problems
    where = f"distributed.ds_config = {path!r}"
    cfg = resolved.config
    problems: list[str] = []
    if "bfloat16" in body and "bf16" not in body:
        body["bf16"] = body.pop("bfloat16")  # DeepSpeed's legacy spelling; one name from here on

    # Hard-coded values first (before filling, so a filled `auto` is never compared with itself).
    slots = _slots(resolved)
    problems.extend(_hard_coded_problems(body, slots, resolved, where))

    # Precision as the file states it (an `auto` follows train.precision, so it is checked before filling).
    problems.extend(_precision_problems(body, cfg.train.precision, where))

    # Every `auto`: filled from zerofit's values, or refused if zerofit has none for that key.
    problems.extend(_fill_autos(body, slots, cfg.model.name_or_path, where))

    problems.extend(_optimizer_problems(body, cfg.optimizer.name, where))
    problems.extend(_scheduler_problems(body, cfg.scheduler.name, where))
    return body, problems


def _precision_problems(body: dict[str, Any], precision: str, where: str) -> list[str]:
    """Both half precisions on, or one that contradicts train.precision (`auto` contradicts nothing)."""
    enabled: dict[str, bool | None] = {}
    problems: list[str] = []
    for mode in ("fp16", "bf16"):
        present, value = _get(body, f"{mode}.enabled")
        if value == AUTO:
            present = False
        elif present and not isinstance(value, bool):
            problems.append(f'{where} sets {mode}.enabled = {value!r}; use true, false or "auto"')
            value = None
        enabled[mode] = value if present else None
    if enabled["fp16"] and enabled["bf16"]:
        problems.append(
            f"{where} enables both fp16 and bf16; DeepSpeed trains in one of them. Fix: keep one (or set both "
            f'"enabled" to "auto") and set train.precision to match (now {precision!r})'
        )
        return problems
    for mode in ("fp16", "bf16"):
        if enabled[mode] is True and precision != mode:
            problems.append(
                f"{where} enables {mode} ({mode}.enabled = true) but train.precision = {precision!r}. Fix: set "
                f'train.precision={mode}, or set "{mode}": {{"enabled": "auto"}} in the file so it follows '
                "train.precision"
            )
        if enabled[mode] is False and precision == mode:
            problems.append(
                f"{where} disables {mode} ({mode}.enabled = false) but train.precision = {precision!r}. Fix: set "
                f'"{mode}": {{"enabled": "auto"}} in the file, or choose another train.precision'
            )
    return problems


def _optimizer_problems(body: dict[str, Any], optimizer_name: str, where: str) -> list[str]:
    """An `optimizer` block makes DeepSpeed build the optimizer; it must be the one zerofit was asked for."""
    block = body.get("optimizer")
    if block is None:
        return []
    kind = block.get("type") if isinstance(block, dict) else None
    if optimizer_name != "adamw":
        return [
            f"{where} has an optimizer block (type {kind!r}), so DeepSpeed would build its own optimizer, but "
            f"optimizer.name = {optimizer_name!r}. Fix: delete the file's optimizer block to use "
            f"{optimizer_name}, or set optimizer.name=adamw"
        ]
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        return [
            f"{where} has an optimizer block of type {kind!r}; zerofit's optimizer settings (optimizer.*) "
            'describe AdamW only. Fix: use "type": "AdamW" with "auto" params, or delete the block'
        ]
    return []


def _scheduler_problems(body: dict[str, Any], scheduler_name: str, where: str) -> list[str]:
    """A `scheduler` block is honoured: DeepSpeed builds and steps that schedule, and zerofit passes no
    scheduler of its own (scheduler.name is then not used, which the plan says). It must be one DeepSpeed
    knows; anything else would fail inside deepspeed.initialize."""
    if "scheduler" not in body:
        return []
    block = body["scheduler"]
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in DEEPSPEED_SCHEDULERS:
        return []
    return [
        f"{where} has a scheduler block of type {kind!r}, which DeepSpeed does not build (it knows "
        f"{', '.join(DEEPSPEED_SCHEDULERS)}). Fix: use one of those types, or delete the block to use zerofit's "
        f"schedule (scheduler.name = {scheduler_name!r})"
    ]


def filled_user_ds_config(resolved: ResolvedConfig) -> dict[str, Any]:
    """The user's DeepSpeed file with every `auto` filled; `ConfigError` listing all conflicts otherwise."""
    body, problems = _fill(resolved)
    if problems:
        raise ConfigError(problems)
    return body
