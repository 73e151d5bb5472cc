"""Config rules of the engine: the strategy and preset settled, the world size against them, the data-parallel
size, sequence parallelism and its head counts, and the ZeRO stage of a preset."""

from __future__ import annotations

from pathlib import Path

from zerofit.catalogue.presets import DEFAULT_PRESET, list_presets
from zerofit.config.schema import ZerofitConfig


def settle_engine(cfg: ZerofitConfig) -> list[str]:
    """Switching engine takes one override; returns what was decided, for the plan to say.

    - `distributed.strategy=X` on the command line, over a config file whose preset (or DeepSpeed file)
      belongs to another engine: X's default preset replaces it (single / ddp take none).
    - `distributed.preset=P` on the command line, or a preset with no strategy written anywhere: P's
      engine is the strategy.
    Both written in the same place and contradicting each other stays an error (resolve() says so).
    """
    d, overridden = cfg.distributed, cfg.overridden
    presets = list_presets()
    notes: list[str] = []
    owner = presets[d.preset].strategy if d.preset in presets else None
    strategy_cli, preset_cli = "distributed.strategy" in overridden, "distributed.preset" in overridden
    strategy_written = "strategy" in d.model_fields_set
    if owner is not None and owner != d.strategy:
        if (preset_cli and not strategy_cli) or not strategy_written:
            if strategy_written:
                notes.append(
                    f"distributed.preset = {d.preset!r} is a {owner} preset, so distributed.strategy = {owner!r} "
                    f"(the config file said {d.strategy!r})"
                )
            d.strategy = owner  # type: ignore[assignment]
        elif strategy_cli and not preset_cli:
            default = DEFAULT_PRESET[d.strategy]
            notes.append(
                f"distributed.strategy = {d.strategy!r} replaces the config file's {owner} preset {d.preset!r} "
                + (
                    f"with {d.strategy}'s default preset {default!r}"
                    if default
                    else f"({d.strategy} takes no preset)"
                )
            )
            d.preset = default
    if (
        d.ds_config is not None
        and d.strategy != "deepspeed"
        and strategy_cli
        and "distributed.ds_config" not in overridden
    ):
        notes.append(
            f"distributed.strategy = {d.strategy!r}: the config file's DeepSpeed file distributed.ds_config = "
            f"{d.ds_config!r} is not used"
        )
        d.ds_config = None
    return notes


def preset_zero_stage(cfg: ZerofitConfig) -> int | None:
    """The ZeRO stage of a DeepSpeed run's `distributed.preset`, None for another engine or no preset."""
    d = cfg.distributed
    if d.strategy == "deepspeed" and d.preset is not None and d.preset in list_presets():
        return list_presets()[d.preset].body.get("zero_optimization", {}).get("stage")
    return None


def check_engine(problems: list[str], cfg: ZerofitConfig, world_size: int) -> None:
    """Decide the preset (the strategy's default when unset) and check the engine fits the launch: the
    world size suits the strategy, the preset exists and belongs to it, a DeepSpeed file exists."""
    strategy = cfg.distributed.strategy
    if world_size < 1:
        problems.append(f"world size {world_size} must be >= 1")
    if strategy == "single" and world_size > 1:
        problems.append(
            f"distributed.strategy = 'single' runs one process, but the launcher started {world_size}; "
            "use distributed.strategy=deepspeed, fsdp or ddp for several ranks, or launch one process"
        )
    if cfg.distributed.preset is None:
        cfg.distributed.preset = DEFAULT_PRESET[strategy]
    check_preset(problems, cfg.distributed.preset, strategy)
    ds_config = cfg.distributed.ds_config
    if ds_config is not None:
        if strategy != "deepspeed":
            problems.append(
                f"distributed.ds_config = {ds_config!r} is a DeepSpeed config but "
                f"distributed.strategy = {strategy!r}; set distributed.strategy=deepspeed or drop ds_config"
            )
        elif not Path(ds_config).is_file():
            problems.append(f"distributed.ds_config = {ds_config!r}: file does not exist")


def data_parallel_size(cfg: ZerofitConfig, world_size: int) -> int:
    """Data-parallel ranks: the world, over the ranks that share one sequence (`distributed.sequence_parallel`;
    a size that does not divide the world is refused by `check_sequence_parallel`, and counts as 1 here)."""
    sp = cfg.distributed.sequence_parallel
    return world_size // sp if sp > 0 and world_size % sp == 0 else world_size


def check_sequence_parallel(
    problems: list[str], cfg: ZerofitConfig, world_size: int, splits_rows: bool
) -> None:
    """`distributed.sequence_parallel` > 1: DeepSpeed only, dividing the world size, SFT on padded
    micro-batches (the head counts are checked against the model's config before its weights load)."""
    sp, d = cfg.distributed.sequence_parallel, cfg.distributed
    if sp <= 1:
        return
    key = f"distributed.sequence_parallel = {sp}"
    if d.strategy != "deepspeed":
        problems.append(
            f"{key} needs DeepSpeed's Ulysses all-to-all attention, and distributed.strategy = "
            f"{d.strategy!r} has none; set distributed.strategy=deepspeed, or distributed.sequence_parallel=1"
        )
    if world_size % sp:
        problems.append(
            f"{key} must divide the world size ({world_size} rank(s)): each group of {sp} ranks shares one "
            f"sequence; launch a multiple of {sp} ranks, or set distributed.sequence_parallel to a divisor "
            f"of {world_size}"
        )
    if cfg.batch.tokens_per_micro_batch is not None:
        problems.append(
            f"{key} shards padded micro-batches, and batch.tokens_per_micro_batch packs documents into "
            "rows, which zerofit does not shard across ranks yet; set batch.micro_batch_size instead"
        )
    if not splits_rows:  # the objective's rows cannot be cut across ranks (`ObjectiveSpec.sequence_parallel`)
        problems.append(
            f"{key} supports train.objective = 'sft' only (a pair's rows would be cut across ranks), not "
            f"{cfg.train.objective!r}; set distributed.sequence_parallel=1 for preference training"
        )
    heads = _head_count_problem(cfg.model.name_or_path, sp)
    if heads is not None:
        problems.append(heads)
    if cfg.model.attn_implementation == "eager":
        problems.append(
            f"{key} runs attention on the whole sequence after DeepSpeed's all-to-all, which needs "
            "model.attn_implementation = 'sdpa' (eager builds a full 4-D mask); set model.attn_implementation=sdpa"
        )


def _head_count_problem(model: str, sp: int) -> str | None:
    """The head-count rule (`sequence_parallel.head_count_problem`) for a catalogued model or a local
    folder, read without network; any other model is checked from its config before its weights load
    (`model.check_heads_before_load`)."""
    from zerofit.catalogue.models import CATALOGUE, model_config_dict
    from zerofit.levers.sequence_parallel import head_count_problem

    if model not in CATALOGUE and not (Path(model) / "config.json").is_file():
        return None
    config = model_config_dict(model)
    config = config.get("text_config") or config
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return None
    return head_count_problem(heads, int(config.get("num_key_value_heads") or heads), sp)


def check_preset(problems: list[str], preset_name: str | None, strategy: str) -> None:
    """The preset is a known one, of `strategy`'s engine (None: the strategy takes none)."""
    presets = list_presets()
    if preset_name is None:
        return
    if preset_name not in presets:
        listing = ", ".join(f"{n} ({p.strategy})" for n, p in presets.items())
        problems.append(f"distributed.preset = {preset_name!r} is not a known preset; available: {listing}")
    elif presets[preset_name].strategy != strategy:
        owner = presets[preset_name].strategy
        same = [n for n, p in presets.items() if p.strategy == strategy]
        problems.append(
            f"distributed.preset = {preset_name!r} is a {owner} preset but "
            f"distributed.strategy = {strategy!r}; set distributed.strategy={owner}"
            + (f" or pick one of: {', '.join(same)}" if same else " or drop distributed.preset")
        )
