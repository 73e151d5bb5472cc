"""`resolve()`: check a whole config against the launch, collect every problem, derive every value.

A short sequence of named steps (`resolve` reads top to bottom): settle the engine, check the engine,
the batch (solved here unless the micro-batch is `auto`), the training keys, the run length, quantization,
the data and the model; then, only when none of them found a problem, let the plan chooser decide the
`auto` keys (`_choose`: its candidates are resolved by this very function, so a problem elsewhere must not
reach it); then fill the batch, the W&B mode and the run directory. Bounds of single values are not here: they are
constraints on the schema's fields, checked (and worded) when the config is validated (`loader.py`).

After `resolve()` nothing is left for later layers to guess: the batch triple is exact for the launcher's
world size, the preset and W&B mode are concrete, the run name and run directory are fixed.
`auto` (`batch.micro_batch_size`, `batch.tokens_per_micro_batch`, `train.activation_checkpointing`,
`train.tiled_mlp`, `train.activation_offload`, `train.lean_norm`) is decided here too, by the plan chooser the caller passes in (the memory planner's,
`zerofit.planner.choose_fastest_plan`): the config layer sits below the planner and never imports it.
A token budget (`batch.tokens_per_micro_batch`) is a micro-batch of packed rows: tokens / max_seq_len
rows, which is what `batch.micro_batch_size` holds after `resolve()`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from zerofit.catalogue.models import is_builtin_model, soft_caps_attention
from zerofit.catalogue.presets import DEFAULT_PRESET, list_presets
from zerofit.config.batching import BatchConfigError, BatchSplit, solve_batch
from zerofit.config.schema import DEFAULT_MAX_STEPS, ZerofitConfig
from zerofit.core.data_files import DATA_FILE_SUFFIXES  # a path with one of them names a local file
from zerofit.core.errors import ConfigError
from zerofit.core.run_layout import run_dir_of


@dataclass(frozen=True)
class PlanChoice:
    """What the planner decides for the `auto` keys: the micro-batch (rows of packed tokens under a token
    budget), the decoder layers to checkpoint (`true`, `false` or a number), the MLP's token shards
    (`false` or a number), whether the checkpointed inputs are offloaded to host memory and whether the
    RMSNorms are lean (`train.lean_norm`), and the loss (`train.cross_entropy`: `chunked` or
    `fused_linear`). A value is written into the config only where its key is `auto`."""

    micro_batch_size: int
    activation_checkpointing: bool | int
    tiled_mlp: bool | int = False
    activation_offload: bool = False
    lean_norm: bool = False
    cross_entropy: str = "chunked"
    loss_reason: str = ""  # why `train.cross_entropy: auto` became `cross_entropy` (the plan's note)


# `auto` batch / checkpointing keys: (config, world size) -> the plan to use; raises ConfigError.
PlanChooser = Callable[[ZerofitConfig, int], PlanChoice]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(path: str) -> bool:
    """True for `org/name` or `name` that is no data-file name: `data.path` is then a hub dataset id.

    Only consulted for paths that do not exist locally, so `data/missing.jsonl` stays a missing file.
    """
    return bool(_HUB_ID.match(path)) and not path.lower().endswith(DATA_FILE_SUFFIXES)


@dataclass(frozen=True)
class ResolvedConfig:
    """A config with every derived value filled, plus the batch plan and run directory it implies."""

    config: ZerofitConfig
    batch: BatchSplit
    world_size: int
    run_dir: Path
    # What resolve() decided that the user did not literally write (an engine switch), for the plan to say.
    notes: tuple[str, ...] = ()

    @property
    def effective_lr(self) -> float:
        """`optimizer.lr` after the opt-in scaling with the global batch (`optimizer.lr_scaling`)."""
        opt = self.config.optimizer
        if opt.lr_scaling == "none" or opt.base_batch_size is None:
            return opt.lr
        ratio = self.batch.global_batch_size / opt.base_batch_size
        return opt.lr * (ratio if opt.lr_scaling == "linear" else math.sqrt(ratio))

    @property
    def method(self) -> str:
        """How the model is adapted (`full`, `lora`, `qlora`, `lora-8bit`)."""
        return adaptation_method(self.config)


def adaptation_method(cfg: ZerofitConfig) -> str:
    """`full`, `lora`, `qlora` or `lora-8bit`: how the model is adapted, for names and tables."""
    if not cfg.lora.enabled:
        return "full"
    return {"none": "lora", "4bit": "qlora", "8bit": "lora-8bit"}[cfg.quantization.load_in]


def _model_short_name(name_or_path: str) -> str:
    return Path(name_or_path.rstrip("/")).name or name_or_path


def default_run_name(cfg: ZerofitConfig, plan: BatchSplit) -> str:
    """A name that says model, method, preset, precision and global batch, so runs compare at a glance.

    Not the split (micro x accum x dp): it depends on the world size, and a run resumed on another world
    size must find its own run directory.
    """
    engine = cfg.distributed.preset or cfg.distributed.strategy
    return (
        f"{_model_short_name(cfg.model.name_or_path)}-{adaptation_method(cfg)}-{engine}-{cfg.train.precision}-"
        f"g{plan.global_batch_size}"
    )


def config_keys(model: type[BaseModel] = ZerofitConfig, prefix: str = "") -> list[str]:
    """Every dotted key and section of the schema (`optimizer`, `optimizer.lr`, ...)."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += config_keys(annotation, f"{prefix}{name}.")
    return out


def wandb_key_configured() -> bool:
    """True when W&B has an API key here (`WANDB_API_KEY` or a ~/.netrc entry for api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def _settle_engine(cfg: ZerofitConfig) -> list[str]:
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


def micro_batch_setting(cfg: ZerofitConfig, problems: list[str] | None = None) -> int | str | None:
    """`batch.micro_batch_size`, or under a token budget the rows per micro-batch it gives (`auto` stays
    `auto`). Problems with the token budget are appended to `problems` (and give None)."""
    b, seq = cfg.batch, cfg.data.max_seq_len
    tokens = b.tokens_per_micro_batch
    if tokens is None:
        return b.micro_batch_size
    found = problems if problems is not None else []
    if b.micro_batch_size is not None:
        found.append(
            f"batch.tokens_per_micro_batch = {tokens!r} and batch.micro_batch_size = {b.micro_batch_size!r}: a "
            "token budget decides the micro-batch (tokens / data.max_seq_len packed rows), so set one of them"
        )
        return None
    if tokens == "auto":
        return "auto"
    if tokens <= 0 or seq <= 0 or tokens % seq:
        lower, upper = max(seq, tokens // max(seq, 1) * seq), (tokens // max(seq, 1) + 1) * seq
        found.append(
            f"batch.tokens_per_micro_batch = {tokens}: examples are packed into rows of data.max_seq_len = {seq} "
            f"tokens, so the budget must be a positive multiple of {seq} (e.g. {lower} or {upper})"
        )
        return None
    return tokens // seq


def _auto_keys(cfg: ZerofitConfig) -> list[str]:
    """The batch / checkpointing keys set to `auto` (the plan chooser decides them)."""
    b = cfg.batch
    return [
        key
        for key, value in (
            ("batch.micro_batch_size", b.micro_batch_size),
            ("batch.tokens_per_micro_batch", b.tokens_per_micro_batch),
            ("train.activation_checkpointing", cfg.train.activation_checkpointing),
            ("train.tiled_mlp", cfg.train.tiled_mlp),
            ("train.activation_offload", cfg.train.activation_offload),
            ("train.lean_norm", cfg.train.lean_norm),
            ("train.cross_entropy", cfg.train.cross_entropy),
        )
        if value == "auto"
    ]


def _check_batch(
    cfg: ZerofitConfig, world_size: int, chooser: PlanChooser | None, problems: list[str]
) -> BatchSplit | None:
    """The exact split of a given micro-batch (None while it is `auto`: `_choose` solves it), or problems
    appended. Nothing is chosen here: the chooser runs last, on a config every other check passed."""
    b = cfg.batch
    micro = micro_batch_setting(cfg, problems)
    if micro is None and b.tokens_per_micro_batch is not None:
        return None  # the token budget's problem is already reported
    autos = _auto_keys(cfg)
    if autos and chooser is None:
        problems.append(
            f"{' and '.join(autos)} = 'auto' needs the memory planner to choose it, and this entry point has "
            "none; set a value instead of auto"
        )
        return None
    if micro == "auto":
        return None
    try:
        dp = data_parallel_size(cfg, world_size)
        return solve_batch(dp, b.global_batch_size, micro, b.grad_accum_steps)  # type: ignore[arg-type]
    except BatchConfigError as exc:
        problems.append(_batch_problem(cfg, exc))
        return None


def _choose(
    cfg: ZerofitConfig, world_size: int, chooser: PlanChooser | None, plan: BatchSplit | None
) -> tuple[BatchSplit, PlanChoice | None]:
    """The planner's choice for the `auto` keys and the split it gives; raises its problems.

    Called once every check found nothing wrong: the chooser weighs candidate runs that `resolve()` itself
    derives, and a problem elsewhere in the config must be reported as itself, not as "nothing fits".
    """
    if not _auto_keys(cfg):
        assert plan is not None  # solved by `_check_batch`
        return plan, None
    assert chooser is not None  # `_check_batch` reported auto without a chooser
    choice = chooser(cfg, world_size)  # raises ConfigError (with the remedies) when nothing fits
    if plan is not None:
        return plan, choice
    try:
        dp = data_parallel_size(cfg, world_size)
        return solve_batch(dp, cfg.batch.global_batch_size, choice.micro_batch_size, None), choice
    except BatchConfigError as exc:
        raise ConfigError([_batch_problem(cfg, exc)]) from None


def _batch_problem(cfg: ZerofitConfig, exc: BatchConfigError) -> str:
    """A batch split error, said in the token budget's terms when that is what the user set."""
    tokens, seq = cfg.batch.tokens_per_micro_batch, cfg.data.max_seq_len
    if cfg.train.objective == "grpo":  # the global batch is completions, set by the rl keys
        rl = cfg.rl
        return (
            f"batch: train.objective = 'grpo' trains on rl.num_generations x rl.prompts_per_step = "
            f"{rl.num_generations} x {rl.prompts_per_step} completions per step (the global batch), split into "
            f"micro-batches of batch.micro_batch_size completions over the ranks: {exc} (or change "
            "rl.num_generations / rl.prompts_per_step)"
        )
    if tokens is None:
        return f"batch: {exc}"
    return (
        f"batch: batch.tokens_per_micro_batch = {tokens} packs {seq}-token rows, {tokens // seq if isinstance(tokens, int) else 'auto'} "
        f"per micro-batch, and the micro-batch counts rows here (multiply a valid micro_batch_size by {seq} "
        f"for a valid token budget): {exc}"
    )


def _check_data_path(problems: list[str], key: str, path: str) -> None:
    """A local file or folder that exists, or a hub dataset id (checked when the data loads)."""
    if not Path(path).expanduser().exists() and not looks_like_hub_id(path):
        problems.append(
            f"{key} = {path!r}: file does not exist (relative paths are from {os.getcwd()}); give a data file "
            f"({', '.join(DATA_FILE_SUFFIXES)}), a `datasets` save_to_disk folder or a hub dataset id (org/name)"
        )


def model_path_problem(name: str) -> str | None:
    """A `model.name_or_path` that is a path (or an existing folder) but no model folder, said with the fix.

    A name that is neither a path nor a folder here is a hub id: the hub says whether it exists (`models/hub.py`).
    """
    if is_builtin_model(name):
        return None
    folder = Path(name).expanduser()
    model_folder = "a model folder (config.json, the tokenizer files and the weights, as save_pretrained or `hf download` writes it)"
    if folder.is_dir():
        if (folder / "config.json").is_file():
            return None
        return (
            f"model.name_or_path = {name!r}: that folder has no config.json, so it is not {model_folder}; "
            "point it at the folder that holds config.json, or use a hub id such as meta-llama/Llama-2-7b-hf"
        )
    if name.startswith((".", "/", "~")):
        return (
            f"model.name_or_path = {name!r} is neither an existing folder nor a Hugging Face hub id (which "
            f"looks like org/name): fix the path to {model_folder}, or use a hub id such as "
            "meta-llama/Llama-2-7b-hf (or tiny-llama, the built-in test model)"
        )
    return None


def _check_data(problems: list[str], cfg: ZerofitConfig) -> None:
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


def _check_objective_data(problems: list[str], cfg: ZerofitConfig) -> None:
    """The objective and the data agree: preference pairs for dpo / simpo / orpo, not for sft (with
    `data.format: auto` the data says it when read), and preference pairs are not packed."""
    objective, fmt, tokens = cfg.train.objective, cfg.data.format, cfg.batch.tokens_per_micro_batch
    if objective == "kto":
        _check_kto(problems, cfg)
        return
    if fmt == "unpaired":
        problems.append(
            f"data.format = 'unpaired' is KTO's {{prompt, completion, label}} feedback, and train.objective = "
            f"{objective!r} does not learn from it; set train.objective=kto, or data.format to the data's format"
        )
    if objective == "sft" and fmt == "preference":
        problems.append(
            "data.format = 'preference' is preference pairs (prompt, chosen, rejected), and train.objective = "
            "'sft' learns from one response per record; set train.objective=dpo (or simpo / orpo) to tune on "
            "the pairs, or set data.format to the supervised data's format"
        )
    if objective in ("sft", "grpo"):  # grpo's prompts: `_check_rl`
        pass
    elif fmt not in ("preference", "auto"):
        problems.append(
            f"train.objective = {objective!r} learns from preference pairs, and data.format = {fmt!r} has one "
            "response per record; set data.format=preference (or auto) with data.path at {prompt, chosen, "
            "rejected} records, or train.objective=sft"
        )
    if objective not in ("sft", "grpo") and tokens is not None:
        problems.append(
            f"batch.tokens_per_micro_batch = {tokens!r} packs examples into rows, and train.objective = "
            f"{objective!r} trains on preference pairs, which zerofit does not pack (yet); unset "
            "batch.tokens_per_micro_batch and set batch.micro_batch_size (pairs per micro-batch: each is a "
            "forward of twice as many sequences), or auto"
        )


def _check_kto(problems: list[str], cfg: ZerofitConfig) -> None:
    """KTO reads unpaired {prompt, completion, label} records (data.format auto), unpacked, and its
    reference is the base with the LoRA adapters off, so it needs LoRA."""
    fmt, tokens = cfg.data.format, cfg.batch.tokens_per_micro_batch
    if fmt not in ("auto", "unpaired"):
        problems.append(
            f"train.objective = 'kto' learns from unpaired {{prompt, completion, label}} records (TRL's "
            f"layout), and data.format = {fmt!r} names another format; set data.format=auto (or unpaired) with data.path at "
            "such records"
        )
    if tokens is not None:
        problems.append(
            f"batch.tokens_per_micro_batch = {tokens!r} packs examples into rows, and train.objective = 'kto' "
            "does not pack (yet); unset it and set batch.micro_batch_size (examples per micro-batch)"
        )
    if not cfg.lora.enabled:
        problems.append(
            "train.objective = 'kto' compares the policy with a reference model, which zerofit takes as the "
            "base with the LoRA adapters switched off (no second copy), and lora.enabled = false leaves no "
            "adapters: KTO's mismatched-completion reference point changes with every global batch, so it "
            "cannot be precomputed as DPO's reference is. Set lora.enabled=true (or train.objective=dpo on "
            "preference pairs for full fine-tuning with a precomputed reference)"
        )


def _settle_reward_loss(problems: list[str], cfg: ZerofitConfig) -> None:
    """`train.objective: reward` scores sequences with a one-output head: no loss over a vocabulary, so
    `train.cross_entropy` is refused unless chunked / auto, and set to chunked (the planner has no choice
    to make, and `train.kernels=liger` does not make it fused_linear)."""
    t = cfg.train
    if t.objective != "reward":
        return
    if t.cross_entropy not in ("chunked", "auto"):
        problems.append(
            f"train.cross_entropy = {t.cross_entropy!r} with train.objective = 'reward': a reward model's loss is "
            "on its one-output score head, not over the vocabulary, so there is no cross-entropy to choose; "
            "unset train.cross_entropy (or set chunked)"
        )
    else:
        t.cross_entropy = "chunked"


def preset_zero_stage(cfg: ZerofitConfig) -> int | None:
    """The ZeRO stage of a DeepSpeed run's `distributed.preset`, None for another engine or no preset."""
    d = cfg.distributed
    if d.strategy == "deepspeed" and d.preset is not None and d.preset in list_presets():
        return list_presets()[d.preset].body.get("zero_optimization", {}).get("stage")
    return None


def _rl_engine_problem(cfg: ZerofitConfig) -> str | None:
    """Why the rollouts cannot run on this engine, or None: sampling runs one forward per token, and under
    ZeRO-3 each would gather every layer again (FSDP2's layers are gathered once per rollout instead,
    `zerofit.loop.rollout.generating`)."""
    d = cfg.distributed
    if preset_zero_stage(cfg) == 3:
        return (
            "train.objective = 'grpo' generates its completions inside the run, and distributed.preset = "
            f"{d.preset!r} is ZeRO-3, which shards the parameters over the ranks, so each generated token would "
            "gather every layer again (zerofit does not gather them once per rollout there yet); use "
            "distributed.strategy=ddp, "
            "deepspeed with preset zero2, fsdp (its layers are gathered once per rollout), or single"
        )
    return None


def _fill_rl_batch(problems: list[str], cfg: ZerofitConfig) -> None:
    """GRPO's batch rule: the global batch is rl.num_generations x rl.prompts_per_step completions, split
    micro x accumulation x dp as any global batch (`_check_batch` refuses a split that does not divide)."""
    rl, b = cfg.rl, cfg.batch
    completions = rl.num_generations * rl.prompts_per_step
    if b.global_batch_size is not None and b.global_batch_size != completions:
        problems.append(
            f"batch.global_batch_size = {b.global_batch_size} with train.objective = 'grpo', whose global batch "
            f"is rl.num_generations x rl.prompts_per_step = {rl.num_generations} x {rl.prompts_per_step} = "
            f"{completions} completions; unset batch.global_batch_size (it is set to that) or change the rl keys"
        )
    b.global_batch_size = completions


def _check_rl(problems: list[str], cfg: ZerofitConfig) -> None:
    """`train.objective: grpo` with the `rl` section: the global batch is rl.num_generations x
    rl.prompts_per_step completions (batch.global_batch_size is that or unset, and is set to it), at least
    one reward, a generation backend that runs here, an engine that can generate, no packing, no
    evaluation data, no sequence parallelism, and beta > 0 only with LoRA adapters to switch off."""
    rl, b = cfg.rl, cfg.batch
    if cfg.train.objective != "grpo":
        return
    _fill_rl_batch(problems, cfg)
    rules = [
        (
            not rl.rewards,
            "rl.rewards is empty: GRPO needs at least one reward function, e.g. "
            "rl.rewards=[{function: exact_match, column: answer}]",
        ),
        (
            rl.generation_backend == "vllm",
            "rl.generation_backend = 'vllm' needs vLLM on CUDA, which zerofit "
            "does not drive yet; set rl.generation_backend=transformers (the policy's own sampling)",
        ),
        (
            b.tokens_per_micro_batch is not None,
            "batch.tokens_per_micro_batch packs rows, and GRPO's micro-batch "
            "is completions (batch.micro_batch_size completions each); unset batch.tokens_per_micro_batch",
        ),
        (
            cfg.data.eval_path is not None or cfg.data.eval_split is not None,
            "data.eval_path / data.eval_split "
            "with train.objective = 'grpo': held-out rewards are not evaluated during the run yet; unset them",
        ),
        (
            cfg.distributed.sequence_parallel > 1,
            "distributed.sequence_parallel > 1 with train.objective = "
            "'grpo': rollouts are not sharded over the sequence; set distributed.sequence_parallel=1",
        ),
        (
            rl.beta > 0 and not cfg.lora.enabled,
            f"rl.beta = {rl.beta} needs the reference, the base with the LoRA "
            "adapters switched off, and lora.enabled = false leaves none; set lora.enabled=true or rl.beta=0",
        ),
        (
            rl.temperature != 1.0 and cfg.train.cross_entropy == "fused_linear",
            f"rl.temperature = "
            f"{rl.temperature} scales the logits, which train.cross_entropy = 'fused_linear' never forms; set "
            "train.cross_entropy=chunked or rl.temperature=1.0",
        ),
        (
            cfg.data.format not in ("auto", "prompt"),
            f"data.format = {cfg.data.format!r} with train.objective = 'grpo', "
            "which reads prompts ({prompt: ..., other columns}); set data.format=auto (or prompt)",
        ),
    ]
    problems.extend(text for broken, text in rules if broken)
    engine = _rl_engine_problem(cfg)
    if engine is not None:
        problems.append(engine)


def _check_reference(problems: list[str], cfg: ZerofitConfig) -> None:
    """`preference.reference` fits the objective: DPO needs one (adapters off only with LoRA adapters to
    switch off), SimPO, ORPO and SFT have none."""
    objective, reference = cfg.train.objective, cfg.preference.reference
    if reference == "auto":
        return
    if objective == "dpo" and reference == "none":
        problems.append(
            "preference.reference = 'none' with train.objective = 'dpo': DPO's loss is the policy's log-prob "
            "ratio against a reference model's; set preference.reference=auto (adapters_off under LoRA, "
            "else precomputed), or train.objective=simpo / orpo, which need none"
        )
    if objective == "dpo" and reference == "adapters_off" and not cfg.lora.enabled:
        problems.append(
            "preference.reference = 'adapters_off' uses the base model with the LoRA adapters switched off "
            "as the reference, and lora.enabled = false leaves no adapters to switch off; set "
            "preference.reference=precomputed (log-probs computed once before training) or auto, or "
            "lora.enabled=true"
        )
    if objective != "dpo" and reference != "none":
        problems.append(
            f"preference.reference = {reference!r} with train.objective = {objective!r}, which uses no "
            "reference model (only DPO does), so it would be ignored; set preference.reference=auto (or "
            "none), or train.objective=dpo"
        )


def _check_length(problems: list[str], cfg: ZerofitConfig) -> None:
    """How long the run is: train.max_steps or train.epochs (not both, and epochs only where the step count
    can follow the data), and when it stops early."""
    t = cfg.train
    if t.max_steps is not None and t.epochs is not None:
        problems.append(
            f"train.max_steps = {t.max_steps} and train.epochs = {t.epochs} are both set, and each fixes the "
            "run's length; set one of them (train.epochs=N trains N passes over the data, the plan states the "
            "exact step count; to replace a config file's train.max_steps from the command line, add "
            "train.max_steps=null)"
        )
    if t.epochs is not None and cfg.distributed.ds_config is not None:
        problems.append(
            f"train.epochs = {t.epochs} with distributed.ds_config = {cfg.distributed.ds_config!r}: the step "
            "count of an epoch is known only once the data is loaded, after the DeepSpeed file is filled in; "
            "set train.max_steps instead (the plan of an epochs run prints its step count)"
        )
    _check_early_stopping(problems, cfg)


def _check_early_stopping(problems: list[str], cfg: ZerofitConfig) -> None:
    """Early stopping needs evaluations between steps to count its patience in."""
    es, d = cfg.train.early_stopping, cfg.data
    if es.patience <= 0:
        return
    if d.eval_path is None and d.eval_split is None:
        problems.append(
            f"train.early_stopping.patience = {es.patience} stops the run when eval/loss stops improving, but "
            "there is no evaluation data; set data.eval_path or data.eval_split (e.g. data.eval_split=0.02) "
            "with eval.every_steps, or train.early_stopping.patience=0"
        )
    elif cfg.eval.every_steps <= 0:
        problems.append(
            f"train.early_stopping.patience = {es.patience} counts evaluations during the run, but "
            "eval.every_steps = 0 evaluates only at the end; set eval.every_steps (e.g. 50), or "
            "train.early_stopping.patience=0"
        )


def _liger_available() -> bool:
    """`zerofit.objectives.loss.liger_available`, imported only when asked: `zerofit.objectives.loss` imports torch, and resolving
    a config (`zerofit plan`, `import zerofit`) stays torch-free otherwise."""
    from zerofit.objectives.loss import liger_available

    return liger_available()


def _check_engine(problems: list[str], cfg: ZerofitConfig, world_size: int) -> None:
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
    _check_preset(problems, cfg.distributed.preset, strategy)
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
    a size that does not divide the world is refused by `_check_sequence_parallel`, and counts as 1 here)."""
    sp = cfg.distributed.sequence_parallel
    return world_size // sp if sp > 0 and world_size % sp == 0 else world_size


def _check_sequence_parallel(problems: list[str], cfg: ZerofitConfig, world_size: int) -> None:
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
    if cfg.train.objective != "sft":
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


def _check_preset(problems: list[str], preset_name: str | None, strategy: str) -> None:
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


def _check_training(problems: list[str], cfg: ZerofitConfig) -> None:
    """Rules between keys that a field's own bounds (schema.py) cannot say: LoRA's rank when LoRA is on,
    learning-rate scaling's reference batch, the keys a resume may change."""
    if cfg.lora.enabled and cfg.lora.r <= 0:
        problems.append(f"lora.r = {cfg.lora.r!r}: must be > 0")
    o = cfg.optimizer
    if o.lr_scaling != "none" and o.base_batch_size is None:
        problems.append(
            f"optimizer.lr_scaling = {o.lr_scaling!r} needs optimizer.base_batch_size (the global batch "
            "optimizer.lr was tuned for); set it, or optimizer.lr_scaling=none"
        )
    check_levers(problems, cfg)
    known = config_keys()
    for key in cfg.checkpoint.allow_changes:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"checkpoint.allow_changes: {key!r} is not a config key or section; {hint}(name keys as "
                "dotted paths, e.g. [optimizer.lr,train.max_steps], or whole sections, e.g. [optimizer])"
            )


def check_levers(problems: list[str], cfg: ZerofitConfig) -> None:
    """Activation offload moves the checkpointed layers' inputs to host memory, so it needs checkpointing
    (also applied by `zerofit.models.build` to a config that did not come through `resolve()`)."""
    t = cfg.train
    if t.activation_offload is True and t.activation_checkpointing in (False, 0):
        problems.append(
            f"train.activation_offload = true needs activation checkpointing (train.activation_checkpointing = "
            f"{t.activation_checkpointing!r} checkpoints no layer): it offloads the inputs checkpointed layers "
            "save, and without checkpointing every activation of every layer would cross PCIe twice a step. "
            "Set train.activation_checkpointing=true (or a number of layers, or auto), or "
            "train.activation_offload=false."
        )


def _check_kernels(problems: list[str], cfg: ZerofitConfig) -> None:
    """`train.kernels=liger` needs Liger-Kernel installed, and replaces the RMSNorm forward the lean norm
    replaces too (the same saved tensors): the two are not combined (`auto` lean norm resolves to false)."""
    t = cfg.train
    if t.kernels == "none":
        return
    from zerofit.levers.kernels import LIGER_INSTALL, liger_kernels_available

    if not liger_kernels_available():
        problems.append(
            f"train.kernels = {t.kernels!r} needs Liger-Kernel, which is not installed here (its Triton kernels "
            f"run on CUDA only): {LIGER_INSTALL} on a CUDA machine, or train.kernels=none"
        )
    if t.lean_norm is True:
        problems.append(
            f"train.kernels = {t.kernels!r} with train.lean_norm = true: both replace the RMSNorm forward, and "
            "Liger's RMSNorm already saves only its input and the fp32 rstd (what the lean norm saves); set "
            "train.lean_norm=false (or auto)"
        )


def _fill_kernels(cfg: ZerofitConfig) -> list[str]:
    """With `train.kernels=liger`, the lean norm's `auto` is false (Liger's RMSNorm saves the same), and an
    unset `train.cross_entropy` is Liger's fused linear cross-entropy (`fused_linear`, where lm_head has no
    LoRA adapter); returns the notes the plan prints."""
    t = cfg.train
    if t.kernels == "none":
        return []
    notes: list[str] = []
    if t.lean_norm == "auto":
        t.lean_norm = False
        notes.append(
            "train.lean_norm auto -> false: Liger's RMSNorm (train.kernels=liger) saves the same tensors"
        )
    targets = cfg.lora.target_modules if cfg.lora.enabled else "all-linear"
    lm_head_adapted = not isinstance(targets, str) and any(x.split(".")[-1] == "lm_head" for x in targets)
    if ("cross_entropy" not in t.model_fields_set or t.cross_entropy == "auto") and not lm_head_adapted:
        t.cross_entropy = "fused_linear"
        notes.append(
            "train.cross_entropy -> fused_linear: Liger's fused linear cross-entropy (train.kernels=liger; "
            "set train.cross_entropy to keep another)"
        )
    return notes


def _check_quantization(problems: list[str], cfg: ZerofitConfig) -> None:
    """Quantized base weights are frozen, so they need LoRA, and 8-bit ones cannot be sharded by FSDP2."""
    load_in = cfg.quantization.load_in
    if load_in != "none" and not cfg.lora.enabled:
        problems.append(
            f"quantization.load_in = {load_in!r} freezes quantized base weights, so it needs "
            "LoRA: set lora.enabled=true (QLoRA) or quantization.load_in=none for full fine-tuning"
        )
    # Checked on 2 gloo ranks: 4-bit works under FSDP2 and ZeRO-3 (+offload), 8-bit under ZeRO-3, but
    # FSDP2 re-gathers 8-bit weights as plain tensors without their int8 state and the forward fails.
    if load_in == "8bit" and cfg.distributed.strategy == "fsdp":
        problems.append(
            "quantization.load_in = '8bit' with distributed.strategy = 'fsdp': FSDP2 re-gathers bitsandbytes "
            "8-bit weights as plain tensors without their int8 quantization state, so the forward fails; use "
            "quantization.load_in=4bit (QLoRA shards under FSDP2), or distributed.strategy=deepspeed (8-bit "
            "works with every ZeRO stage), ddp or single"
        )


def _check_model_and_loss(problems: list[str], cfg: ZerofitConfig) -> None:
    """The model path names a model folder (or a hub id), and the chosen loss kernel is installed."""
    model_problem = model_path_problem(cfg.model.name_or_path)
    if model_problem is not None:
        problems.append(model_problem)
    if cfg.train.cross_entropy == "liger" and not _liger_available():
        problems.append(
            "train.cross_entropy = 'liger' needs Liger-Kernel, which is not installed here (it runs on CUDA "
            "only: pip install liger-kernel); use train.cross_entropy=chunked (the default: pure PyTorch, "
            "the same token sums, no full fp32 logits)"
        )


def _check_attention(problems: list[str], cfg: ZerofitConfig) -> None:
    """An explicit `model.varlen_kernel` needs the varlen path, an install that has it and half precision
    (the device is checked when the model loads: `zerofit.levers.attention.choose_kernel`)."""
    import importlib.util

    m, precision = cfg.model, cfg.train.precision
    kernel = m.varlen_kernel
    if kernel == "auto":
        return
    if m.attn_implementation in ("sdpa", "eager"):
        problems.append(
            f"model.varlen_kernel = {kernel!r} with model.attn_implementation = {m.attn_implementation!r}: the "
            "kernel is the varlen path's; set model.attn_implementation=varlen (or auto), or model.varlen_kernel=auto"
        )
    module = {"flash_attn": "flash_attn", "torch_varlen": "torch.nn.attention.varlen"}.get(kernel)
    if module is not None and importlib.util.find_spec(module) is None:
        fix = "pip install flash-attn (CUDA)" if kernel == "flash_attn" else "a torch that has it (2.10+)"
        problems.append(
            f"model.varlen_kernel = {kernel!r}: {module} is not installed here; install it ({fix}) or set "
            "model.varlen_kernel=auto (the best kernel that runs: sdpa_per_document at worst, exact)"
        )
    elif module is not None and precision == "fp32":
        problems.append(
            f"model.varlen_kernel = {kernel!r} with train.precision = 'fp32': the kernel runs in bf16/fp16 "
            "only; set train.precision=bf16, or model.varlen_kernel=sdpa_per_document (or auto) for fp32"
        )


def _fill_attention(cfg: ZerofitConfig) -> None:
    """Decide `model.attn_implementation: auto`: varlen (zerofit.levers.attention), whose mask hook runs
    transformers' plain sdpa (is_causal, no mask) for a micro-batch without documents (one unpadded
    sequence per row) and the documents without a dense (B, 1, S, S) mask where sdpa would build one, so the
    choice does not depend on the micro-batch the planner varies. Remote code (`model.trust_remote_code`)
    keeps sdpa: a custom model need not build its masks through transformers' mask interface. A model that
    soft-caps its attention logits (Gemma-2) gets eager, the only path that computes the cap."""
    cfg.model.attn_implementation = attention_choice(cfg)  # type: ignore[assignment]


def attention_choice(cfg: ZerofitConfig) -> str:
    """`model.attn_implementation` with `auto` decided (`_fill_attention`'s rule; also applied by
    `zerofit.models.build` to a config that did not come through `resolve()`)."""
    m = cfg.model
    if m.attn_implementation != "auto":
        return m.attn_implementation
    if soft_caps_attention(m.name_or_path):
        return "eager"  # Gemma-2's attention-logit soft-capping: only transformers' eager path computes it
    return "sdpa" if m.trust_remote_code and m.varlen_kernel == "auto" else "varlen"


def _fill_batch(cfg: ZerofitConfig, plan: BatchSplit, choice: PlanChoice | None) -> None:
    """Write the decided split, the planner's checkpointing choice and the run length into `cfg`."""
    t = cfg.train
    if choice is not None:
        if t.activation_checkpointing == "auto":
            t.activation_checkpointing = choice.activation_checkpointing
        if t.tiled_mlp == "auto":
            t.tiled_mlp = choice.tiled_mlp
        if t.activation_offload == "auto":
            t.activation_offload = choice.activation_offload
        if t.lean_norm == "auto":
            t.lean_norm = choice.lean_norm
        if t.cross_entropy == "auto":
            t.cross_entropy = choice.cross_entropy  # type: ignore[assignment]
    if cfg.batch.tokens_per_micro_batch is not None:
        cfg.batch.tokens_per_micro_batch = plan.micro_batch_size * cfg.data.max_seq_len
    if t.max_steps is None and t.epochs is None:
        t.max_steps = DEFAULT_MAX_STEPS
    # With train.epochs, train.max_steps stays None here: epochs x steps per epoch is known only once the
    # data is loaded (`zerofit.recipe.assembly`, which fills it in; config.yaml records both).
    cfg.batch.global_batch_size = plan.global_batch_size
    cfg.batch.micro_batch_size = plan.micro_batch_size
    cfg.batch.grad_accum_steps = plan.grad_accum_steps


def _fill_logging(cfg: ZerofitConfig) -> None:
    """Decide the W&B mode: the environment's off switch, else the config's, else by whether a key exists."""
    if os.environ.get("WANDB_MODE") == "disabled":
        # W&B's own off switch (CI, tests, a shell without W&B) wins over the config, as in any W&B program;
        # config.yaml then records the mode that ran.
        cfg.logging.wandb.mode = "disabled"
    elif cfg.logging.wandb.mode is None:
        cfg.logging.wandb.mode = "online" if wandb_key_configured() else "offline"


def _fill_reference(cfg: ZerofitConfig) -> None:
    """Decide `preference.reference: auto`: DPO's reference is the base with the adapters off under LoRA
    (no second copy), else log-probabilities precomputed before training; SimPO, ORPO and SFT have none."""
    pref = cfg.preference
    if pref.reference != "auto":
        return
    if cfg.train.objective != "dpo":
        pref.reference = "none"
    else:
        pref.reference = "adapters_off" if cfg.lora.enabled else "precomputed"


def _fill_run_dir(cfg: ZerofitConfig, plan: BatchSplit) -> Path:
    """Decide the run name (the default one says model, method, preset, precision, global batch) and the
    run directory it names under `output_dir`."""
    name = default_run_name(cfg, plan) if cfg.run_name is None else cfg.run_name
    run_dir = run_dir_of(cfg.output_dir, name)  # one folder name: nothing is written outside output_dir
    cfg.run_name = name
    return run_dir


def resolve(config: ZerofitConfig, world_size: int, choose_plan: PlanChooser | None = None) -> ResolvedConfig:
    """Validate `config` for a launch of `world_size` ranks and fill every derived value.

    `choose_plan` (the planner's chooser, `choose_fastest_plan`) decides every `auto` key (without one,
    `auto` is refused), and is asked only once every check passed (it resolves its candidates with this
    function, without a chooser). Raises one `ConfigError` listing every problem found. Each value's own bounds were checked
    when the config was validated (`schema.py`); the steps here check what depends on several keys or on
    the launch, then decide what the config left open.
    """
    cfg = config.model_copy(deep=True)
    problems: list[str] = []
    notes = _settle_engine(cfg)
    _check_engine(problems, cfg, world_size)
    _check_sequence_parallel(problems, cfg, world_size)
    _check_rl(problems, cfg)  # before the batch: it decides batch.global_batch_size for grpo
    plan = _check_batch(cfg, world_size, choose_plan, problems)
    _check_training(problems, cfg)
    _check_length(problems, cfg)
    _check_quantization(problems, cfg)
    _check_data(problems, cfg)
    _check_objective_data(problems, cfg)
    _check_reference(problems, cfg)
    _settle_reward_loss(problems, cfg)
    _check_model_and_loss(problems, cfg)
    _check_attention(problems, cfg)
    _check_kernels(problems, cfg)
    if problems:
        raise ConfigError(problems)
    notes += _fill_kernels(cfg)
    loss_auto = cfg.train.cross_entropy == "auto"
    plan, choice = _choose(cfg, world_size, choose_plan, plan)
    _fill_batch(cfg, plan, choice)
    if loss_auto:  # the plan says what auto became (config.yaml records it)
        notes.append(
            f"train.cross_entropy auto -> {cfg.train.cross_entropy}: {choice.loss_reason if choice else ''}"
        )
    _fill_attention(cfg)
    _fill_logging(cfg)
    _fill_reference(cfg)
    run_dir = _fill_run_dir(cfg, plan)
    return ResolvedConfig(config=cfg, batch=plan, world_size=world_size, run_dir=run_dir, notes=tuple(notes))
