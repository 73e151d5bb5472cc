"""The typed run configuration (docs/contracts.md, "Config keys").

Every section forbids unknown keys so a typo fails loudly (with a did-you-mean, see `loader.py`) instead of
being silently ignored. A value's own bounds are constraints on its field (`Field(gt=0)`, with a `RuleHint`
saying what the edge means), so every validated config obeys them; rules between keys are `resolve()`'s.
Defaults here are the values a user gets when a key is absent; derived values
(grad_accum_steps, run_name, preset, W&B mode) are left as `None` and filled only by `resolve()`.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from zerofit.catalogue.models import TINY_LLAMA
from zerofit.core.run_layout import run_name_problem

Precision = Literal["bf16", "fp16", "fp32"]
Strategy = Literal["deepspeed", "fsdp", "single", "ddp"]
Objective = Literal[
    "sft", "dpo", "simpo", "orpo", "cpo", "kto", "reward", "grpo", "rloo", "gkd"
]  # train.objective
OptimizerName = Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "lion_8bit"]
# SimPO's gamma / beta when neither preference.simpo_gamma nor preference.simpo_gamma_beta_ratio is set: the
# meaning zerofit's defaults always had (gamma 0.05 at beta 0.1, 1.0 at beta 2).
SIMPO_GAMMA_BETA_RATIO = 0.5


@dataclass(frozen=True)
class RuleHint:
    """What a bounded value means at its edge, e.g. `0 = off`: said after the rule when a value breaks it.

    Attached to a field as `Annotated[int, RuleHint("0 = off")]` beside its `Field(ge=0)`; `loader.py`
    reads it back to word the problem ("train.epochs = 0: must be > 0 (or unset, with train.max_steps)").
    """

    text: str


# The pydantic error type of a true/false given for a number (see `_Section._no_bool_numbers`).
BOOL_NOT_NUMBER = "bool_not_number"
# The pydantic error type of a quoted number given for a float field (see `_Section._no_text_floats`).
TEXT_NOT_NUMBER = "text_not_number"


def _number_field(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float but no true/false: a union's members are looked
    through (`int | None`, `bool | Annotated[int, ...] | Literal["auto"]`); a container's items are not."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _number_field(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        admits_bool = any(_admits_bool(m) for m in members)
        return not admits_bool and any(_number_field(m) for m in members)
    return annotation in (int, float)


def _takes_float_not_text(annotation: Any) -> bool:
    """Whether a field's type takes a float and no free text: a union's members are looked through
    (`float | None`, `Annotated[float, ...]`); a member `str` (`data.eval_split`'s split name) takes text."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _takes_float_not_text(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [
            typing.get_args(m)[0] if typing.get_origin(m) is Annotated else m
            for m in typing.get_args(annotation)
        ]
        return str not in members and any(_takes_float_not_text(m) for m in members)
    return annotation is float


def _finite_number_text(value: str) -> bool:
    """Whether `value` is text Python reads as a finite number (`'3e-3'`, `'0.5'`; not `'inf'`, `'abc'`)."""
    try:
        return math.isfinite(float(value))
    except ValueError:
        return False


def _admits_bool(annotation: Any) -> bool:
    """Whether `annotation` (a union member) takes true or false: `bool`, or a `Literal` of one of them."""
    if annotation is bool:
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(arg, bool) for arg in typing.get_args(annotation))
    return False


class _Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are re-validated, a float is
    finite (`.inf` and `nan` wreck a run: a learning rate of inf trains to a NaN loss), a number is
    never true/false (pydantic alone takes `train.max_steps=true` as 1 step), and a float is never a quoted
    string (pydantic alone reads `optimizer.lr="3e-3"` as 0.003, while its strict fields refuse text)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse true/false for a field that takes a number and no bool (the loader words the message)."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _number_field(field.annotation):
            raise PydanticCustomError(BOOL_NOT_NUMBER, "true/false is not a number")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_text_floats(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse a quoted number (text) for a float field, as pydantic's strict float does; text that is
        no number is left to pydantic's own refusal (the loader words both messages). An unquoted `3e-3`
        reaches here as a float: the loader reads YAML numbers with an exponent as numbers."""
        field = cls.model_fields.get(info.field_name or "")
        if (
            isinstance(value, str)
            and field is not None
            and _takes_float_not_text(field.annotation)
            and _finite_number_text(value)
        ):
            raise PydanticCustomError(
                TEXT_NOT_NUMBER, "a quoted string is text, not a number; write it without quotes"
            )
        return value


class ModelSection(_Section):
    """Which model to fine-tune and how its attention runs."""

    name_or_path: str = Field(
        TINY_LLAMA, description="`tiny-llama` (built-in, random init), a local HF folder, or a hub id."
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "varlen"] = Field(
        "auto",
        description="auto: varlen where sdpa would need a dense (B, 1, S, S) mask (packed rows, padded "
        "micro-batches of several sequences), sdpa otherwise; sdpa / eager: transformers' own; varlen: "
        "zerofit.levers.attention (documents as cu_seqlens, no dense mask).",
    )
    varlen_kernel: Literal["auto", "flash_attn", "torch_varlen", "sdpa_per_document"] = Field(
        "auto",
        description="The varlen path's kernel: auto = FlashAttention-2 where installed, else PyTorch's varlen "
        "(both CUDA, bf16/fp16, sm80+), else exact per-document sdpa.",
    )
    trust_remote_code: bool = False


class QuantizationSection(_Section):
    """Base-weight quantization through bitsandbytes (QLoRA when combined with LoRA)."""

    load_in: Literal["none", "8bit", "4bit"] = "none"
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    fp32_residual: bool = Field(
        True,
        description="Upcast the non-quantized parameters (norms, embeddings, lm_head) to fp32 as peft's k-bit "
        "preparation does, so the residual stream is fp32; false keeps them, and the residual stream, in the "
        "compute dtype (half the bytes of every activation on it).",
    )


class BatchSection(_Section):
    """The batch triple; two of three (plus the launcher's world size) determine the third."""

    global_batch_size: int | None = None
    micro_batch_size: int | Literal["auto"] | None = None
    grad_accum_steps: int | None = Field(None, description="Normally derived from the other two.")
    tokens_per_micro_batch: int | Literal["auto"] | None = Field(
        None,
        description="Token budget of a micro-batch: pack whole examples into rows of data.max_seq_len "
        "tokens, tokens_per_micro_batch / max_seq_len rows per micro-batch (replaces micro_batch_size).",
    )


class DistributedSection(_Section):
    """Engine choice. The data-parallel size always comes from the launcher, never from the config."""

    strategy: Strategy = "deepspeed"
    preset: str | None = Field(None, description="A preset in ds_configs/; default depends on the strategy.")
    ds_config: str | None = Field(
        None, description="A user's own DeepSpeed JSON (HF-style `auto` allowed); overrides the preset."
    )
    timeout_minutes: Annotated[float, RuleHint("minutes a collective may wait for a peer, e.g. 30")] = Field(
        30.0,
        gt=0,
        description="Process-group timeout: how long a collective may wait for a peer before the run fails "
        "(zerofit's own rank-0-only work, tokenizing, verifying, exporting, waits without it).",
    )
    sequence_parallel: Annotated[int, RuleHint("1 = off; e.g. 2 or 4, dividing the world size")] = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism (DeepSpeed only): each sequence is sharded across this "
        "many ranks, attention runs through DeepSpeed's all-to-all; the data-parallel size is world / N.",
    )


class EarlyStoppingSection(_Section):
    """Stop after `patience` evaluations without an `eval/loss` improvement of more than `min_delta`."""

    patience: Annotated[int, RuleHint("0 = off")] = Field(
        0, ge=0, description="Evaluations without improvement before stopping; 0 = off."
    )
    min_delta: float = Field(
        0.0,
        ge=0,
        description="How much lower eval/loss (higher eval/reward, RL objectives) must be to count as improvement.",
    )


DEFAULT_MAX_STEPS = 20  # train.max_steps when neither it nor train.epochs is set


class TrainSection(_Section):
    """Length, numerics and the accumulation-window policy of the run."""

    max_steps: int | None = Field(
        None,
        gt=0,
        description=f"Optimizer steps (not micro-steps); {DEFAULT_MAX_STEPS} when train.epochs is unset too.",
    )
    epochs: Annotated[int | None, RuleHint("or unset, with train.max_steps")] = Field(
        None,
        gt=0,
        description="Passes over the data instead of max_steps: epochs x steps per epoch optimizer steps.",
    )
    early_stopping: EarlyStoppingSection = Field(default_factory=EarlyStoppingSection)
    precision: Precision = "bf16"
    activation_checkpointing: (
        bool
        | Annotated[
            int, Field(ge=0), RuleHint("the number of checkpointed decoder layers; or true, false, auto")
        ]
        | Literal["auto"]
    ) = Field(
        False, description="true, false, the number of decoder layers to recompute (the first n), or auto."
    )
    activation_offload: bool | Literal["auto"] = Field(
        False,
        description="Keep the checkpointed layers' saved inputs in pinned host memory (copied on a side CUDA "
        "stream, prefetched back in backward); needs activation checkpointing (zerofit.levers.offload). auto: the "
        "planner's choice (only where it is needed to fit or is faster).",
    )
    tiled_mlp: (
        Literal[False]
        | Annotated[
            int,
            Field(ge=1, strict=True),
            RuleHint("the number of token shards of each MLP, e.g. 4; or false, auto"),
        ]
        | Literal["auto"]
    ) = Field(
        False,
        description="Run each decoder layer's MLP over this many token shards, forward and backward, so its "
        "intermediates exist for one shard at a time (zerofit.levers.tiling); false = off. auto: the planner's choice "
        "(only where it is needed to fit or is faster).",
    )
    lean_norm: bool | Literal["auto"] = Field(
        False,
        description="The model's RMSNorms save their input in its own dtype and the fp32 rstd instead of the "
        "fp32 upcast input, recomputing the normalized value in backward (zerofit.levers.norms): the same output, "
        "gradients equal up to rounding. auto: the planner's choice (only where it is needed to fit or is faster).",
    )
    cross_entropy: Literal["chunked", "unchunked", "liger", "fused_linear", "auto"] = Field(
        "chunked",
        description=(
            "How the loss runs over the vocabulary (zerofit.token_loss.sums); the same token sums. fused_linear: the "
            "lm_head matmul and the loss together, chunk by chunk of tokens, so the logits never exist "
            "(zerofit.token_loss.fused). auto: the planner's choice between chunked and fused_linear (fused only "
            "where it is needed to fit or is faster, and only where the fused loss applies)."
        ),
    )
    kernels: Literal["none", "liger"] = Field(
        "none",
        description="Fused kernels applied to the loaded model (zerofit.levers.kernels): liger = Liger-Kernel's RMSNorm, "
        "SwiGLU and RoPE (and its fused linear cross-entropy through train.cross_entropy=fused_linear, the "
        "loss when train.cross_entropy is left unset); CUDA only, pip install 'zerofit[liger]'. The same token "
        "sums; opt-in, the planner never turns it on.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (zerofit.levers.compiling), inside its activation checkpoint; "
        "graph breaks are counted and reported (metrics.jsonl compile/graph_breaks). Opt-in, the planner never "
        "turns it on.",
    )
    max_grad_norm: Annotated[float | None, RuleHint("0 or null disables clipping")] = Field(
        1.0, ge=0, description="Clip after the window; null or 0 disables."
    )
    partial_window: Literal["drop", "normalize"] = "drop"
    objective: Objective = Field(
        "sft",
        description="What is learned: sft (next-token loss on the responses) or a preference objective on "
        "{prompt, chosen, rejected} pairs (dpo, simpo, orpo, cpo; the `preference` section), kto on unpaired "
        "{prompt, completion, label} feedback (the `kto` section), or reward: a reward model (a one-output "
        "score head) trained on the pairs with the Bradley-Terry loss (the `reward` section); grpo: online RL "
        "(the `rl` section); gkd: on-policy distillation from a teacher (the `gkd` section).",
    )

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _shards_not_true(cls, value: Any) -> Any:
        """`true` names no shard count (pydantic alone would say `Input should be False`)."""
        if value is True:
            raise ValueError(
                "must be a number of token shards, false or auto (true names no number); e.g. train.tiled_mlp=4"
            )
        return value


def _rate(value: Any) -> bool:
    """A number in [0, 1) (bools are not numbers here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1


class OptimizerSection(_Section):
    """Optimizer and opt-in learning-rate scaling with the effective batch."""

    name: OptimizerName = "adamw"
    lr: float = Field(2e-4, gt=0)
    weight_decay: Annotated[float, RuleHint("0 = off; e.g. 0.01")] = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, RuleHint("added to Adam's denominator for stability, e.g. 1e-8")] = Field(
        1e-8, gt=0
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch_size: int | None = Field(
        None, gt=0, description="The batch `lr` was tuned for (needed for scaling)."
    )

    @field_validator("betas", mode="before")
    @classmethod
    def _two_decay_rates(cls, value: Any) -> Any:
        """Exactly two numbers in [0, 1): pydantic alone says `betas.1 Field required`, and takes 1.5."""
        numbers = isinstance(value, list | tuple) and len(value) == 2
        if not numbers or not all(_rate(v) for v in value):
            raise ValueError(
                "must be two numbers in [0, 1), the decay rates of Adam's first and second moment estimates; "
                "e.g. optimizer.betas=[0.9,0.999]"
            )
        return value


class SchedulerSection(_Section):
    """Learning-rate schedule, stepped once per optimizer step."""

    name: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class LoraSection(_Section):
    """LoRA adapters via peft."""

    enabled: bool = True
    r: int = 16
    alpha: Annotated[
        int, RuleHint("the adapters' scale is alpha / r, so 0 learns nothing; e.g. 2 x lora.r")
    ] = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear", "attention", "mlp"] = Field(
        "all-linear",
        description="A meaning (all-linear, attention, mlp: mapped per model family, fused projections "
        "included) or a list of module names (each matches the end of a module's full name).",
    )
    use_dora: bool = False
    moe_experts: Literal["none", "shared", "all"] = Field(
        "shared",
        description="Mixture-of-experts models, with target_modules mlp / all-linear: none (MoE blocks frozen), "
        "shared (the shared experts, where the family has them), all (shared and every routed expert, through "
        "peft's target_parameters).",
    )
    train_router: bool = Field(
        False,
        description="Mixture-of-experts models: train the router's weights in full (false: routing frozen).",
    )
    projector: Literal["frozen", "full"] = Field(
        "frozen",
        description="Vision-language models: the projector from the vision tower to the language model: frozen, "
        "or trained in full.",
    )
    vision_tower: bool = Field(
        False, description="Vision-language models: LoRA on the vision tower's linears too (false: frozen)."
    )


EmptyResponses = Literal["drop", "keep", "error"]  # data.empty_responses (see zerofit.data.sft)
Truncation = Literal["warn", "error", "allow"]  # data.truncation (see zerofit.data.truncation)
DataFormat = Literal[
    "auto", "prompt_response", "alpaca", "messages", "text", "preference", "unpaired", "prompt"
]


class DataSection(_Section):
    """Training (and evaluation) data: where it is, how its records are laid out, how long a sequence is."""

    path: str = Field(
        "data/demo.jsonl",
        description="A .jsonl/.json/.parquet/.csv file, a `datasets` save_to_disk folder, or a hub dataset id.",
    )
    format: DataFormat = Field("auto", description="How records are laid out; `auto` detects it.")
    split: str = Field("train", description="Split of a hub dataset or a saved DatasetDict.")
    subset: str | None = Field(None, description="Configuration (subset) of a hub dataset.")
    chat_template: str | None = Field(
        None,
        description="Jinja chat template (text or a file) for `messages` data, overriding the tokenizer's.",
    )
    tools_file: str | None = Field(
        None,
        description="A JSON file holding a list of tool schemas: the `tools` of every `messages` record without "
        "its own (a data set whose conversations share one set of tools).",
    )
    max_seq_len: int = Field(512, gt=0)
    empty_responses: EmptyResponses = Field(
        "drop",
        description="Records whose response (or an assistant turn) is empty: drop and count them (refused when "
        "more than half are), keep them (they learn eos only), or refuse the first.",
    )
    truncation: Truncation = Field(
        "warn",
        description="More than 5% of the examples cut to max_seq_len: warn once in the run's plan with the "
        "length that keeps 95% whole, refuse the data (error), or leave it to the plan's count (allow).",
    )
    max_image_tokens: int | None = Field(
        None,
        gt=0,
        description="Vision-language models: the most tokens one image becomes (larger images are resized, "
        "aspect kept, as the image processor's max_pixels does); null: the processor's own limit.",
    )
    max_image_pixels: int | None = Field(
        None,
        gt=0,
        description="Vision-language models: the most pixels one image may have, checked from its header before "
        "it is decoded (a larger one is refused); null: 4 x the largest image the processor uses, at least "
        "2048 x 2048.",
    )
    missing_images: Literal["drop", "error"] = Field(
        "drop",
        description="Vision-language models: records naming an image that cannot be read: drop and count them "
        "(refused when more than half are), or refuse the first.",
    )
    shuffle: bool = True
    cache: bool = Field(True, description="Reuse tokenized data from $ZEROFIT_CACHE/tokenized.")
    eval_path: str | None = Field(None, description="Evaluation data, any source `path` accepts.")
    eval_split: (
        Annotated[float, Field(gt=0, lt=1), RuleHint("a held-out fraction, e.g. 0.02; or a split name")]
        | str
        | None
    ) = Field(
        None, description="A fraction of `path` held out for evaluation, or the name of its eval split."
    )


class RewardSection(_Section):
    """A reward model (`train.objective: reward`): the Bradley-Terry loss's knobs (TRL's RewardConfig names)."""

    center_rewards_coefficient: float | None = Field(
        None,
        ge=0,
        description="TRL's centering term: adds coefficient x mean over the pairs of (r_chosen + r_rejected)^2, "
        "pulling rewards towards mean zero (Eisenstein et al. 2023; TRL recommends 0.01). null: off.",
    )


class PreferenceSection(_Section):
    """Preference tuning (`train.objective` dpo / simpo / orpo / cpo): the method's knobs and the reference model."""

    beta: float = Field(
        0.1, gt=0, description="Inverse temperature of the implicit reward (DPO 0.1, SimPO ~2, ORPO unused)."
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="DPO's loss of the reward margin: sigmoid (DPO), ipo (IPO), hinge (SLiC)."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Conservative DPO: the assumed rate of flipped preference labels."
    )
    simpo_gamma: float | None = Field(
        None,
        ge=0,
        description="SimPO's target reward margin gamma itself, as TRL's simpo_gamma (the same number gives "
        "TRL's loss); a margin given as gamma / beta goes in simpo_gamma_beta_ratio. Unset: "
        "simpo_gamma_beta_ratio x beta.",
    )
    simpo_gamma_beta_ratio: float | None = Field(
        None,
        ge=0,
        description="SimPO's margin as a ratio of beta, gamma / beta (the SimPO authors' gamma_beta_ratio). "
        f"Unset, and simpo_gamma unset: {SIMPO_GAMMA_BETA_RATIO}. Set at most one of the two.",
    )
    orpo_lambda: float = Field(0.1, gt=0, description="ORPO's weight of the odds-ratio term.")
    cpo_alpha: float = Field(
        1.0,
        ge=0,
        description="CPO's weight of the NLL on the chosen response tokens (TRL's cpo_alpha); 0: the "
        "reference-free preference loss alone.",
    )
    orpo_prompt_loss: bool = Field(
        True,
        description="ORPO's NLL over the chosen sequence's prompt and response tokens (TRL's and the ORPO "
        "authors' default); false: over the chosen response tokens only, as SFT learns.",
    )
    reference: Literal["auto", "adapters_off", "precomputed", "none"] = Field(
        "auto",
        description="DPO's reference model: the base with the LoRA adapters switched off (no second copy), "
        "or log-probabilities precomputed once before training and cached with the data. auto: adapters_off "
        "with LoRA, else precomputed. SimPO and ORPO have no reference (none).",
    )

    @field_validator("simpo_gamma_beta_ratio")
    @classmethod
    def _one_simpo_margin(cls, value: float | None, info: ValidationInfo) -> float | None:
        """At most one of simpo_gamma (gamma) and simpo_gamma_beta_ratio (gamma / beta): two would disagree."""
        if value is not None and info.data.get("simpo_gamma") is not None:
            raise ValueError(
                f"preference.simpo_gamma = {info.data['simpo_gamma']} is set too; set one of the two: "
                "preference.simpo_gamma is the margin gamma itself (TRL's simpo_gamma), "
                "preference.simpo_gamma_beta_ratio is gamma / beta (the SimPO authors' gamma_beta_ratio)"
            )
        return value

    def simpo_margin(self) -> float:
        """SimPO's target reward margin gamma itself (TRL's `simpo_gamma`), from whichever key is set."""
        if self.simpo_gamma is not None:
            return self.simpo_gamma
        ratio = SIMPO_GAMMA_BETA_RATIO if self.simpo_gamma_beta_ratio is None else self.simpo_gamma_beta_ratio
        return ratio * self.beta


class KTOSection(_Section):
    """KTO (`train.objective: kto`) on unpaired feedback: TRL's KTOConfig names and defaults."""

    beta: float = Field(0.1, gt=0, description="KTO's beta: how far the policy may move from the reference.")
    desirable_weight: float = Field(
        1.0, gt=0, description="Weight of the desirable (label true) examples' losses."
    )
    undesirable_weight: float = Field(
        1.0, gt=0, description="Weight of the undesirable (label false) examples' losses."
    )


class HarnessSection(_Section):
    """lm-eval during training (`zerofit.harness`): rank 0 scores the step's weights, gathered from every
    rank, on these tasks; the scores join the step's metrics row (`harness/<task>/<metric>`)."""

    tasks: list[str] = Field(
        default_factory=list, description="lm-eval task names (zerofit's shipped ones run offline); [] = off."
    )
    every_steps: Annotated[int, RuleHint("0 = only at the end")] = Field(
        0, ge=0, description="Optimizer steps between harness evaluations; 0 = only after the last step."
    )
    limit: float | None = Field(
        None, gt=0, description="At most this many documents per task (a fraction below 1: that share)."
    )
    apply_chat_template: bool | None = Field(
        None, description="Prompts as a chat turn; null = as the data trains (on for data.format messages)."
    )
    batch_size: int = Field(8, ge=1, description="lm-eval requests per forward.")
    best_metric: str | None = Field(
        None,
        description="`<task>/<metric>` (higher is better) that judges the best checkpoint and early stopping "
        "instead of eval/loss.",
    )


class EvalSection(_Section):
    """When the evaluation (`eval/loss`; an RL objective's `eval/reward`) is computed (on `data.eval_path`
    or `data.eval_split`), and lm-eval's."""

    every_steps: Annotated[int, RuleHint("0 = only at the end")] = Field(
        0, ge=0, description="Optimizer steps between evaluations; 0 = only at the end."
    )
    sampling: Literal["seeded", "greedy"] = Field(
        "seeded",
        description="RL objectives: how each held-out prompt is answered at an evaluation; seeded: sampled "
        "with rl.temperature / top_p / top_k from one fixed seed per prompt (the same at every evaluation); "
        "greedy: the most likely token each time.",
    )
    harness: HarnessSection = Field(default_factory=HarnessSection)


class CheckpointSection(_Section):
    """Checkpointing through the strategy; saves are atomic."""

    every_steps: Annotated[int, RuleHint("0 = at the end")] = Field(
        0, ge=0, description="0 = no step interval (see every_minutes)."
    )
    every_minutes: Annotated[float | None, RuleHint("0 or null = no wall-clock saves")] = Field(
        30.0, ge=0, description="Wall-clock interval between saves (rank 0's clock); 0 or null = none."
    )
    keep_last: int = Field(2, ge=1)
    keep_best: bool = Field(
        True,
        description="Also keep the checkpoint of the best evaluation (the lowest eval/loss; an RL objective's "
        "highest eval/reward), saved at that evaluation.",
    )
    resume: bool | Literal["auto"] = Field(
        False,
        description="Resume from the newest checkpoint of the run dir that verifies: true (it must exist), "
        "auto (if there is one), false (a new run).",
    )

    @field_validator("resume", mode="wrap")
    @classmethod
    def _resume_mode(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        """Any other value is refused with every accepted one (pydantic alone names only the boolean)."""
        try:
            return handler(value)
        except ValueError:  # pydantic's ValidationError is one
            raise ValueError(
                "must be true (resume; a checkpoint must exist), false (a new run) or auto (resume if there "
                "is a checkpoint, else start at step 0); e.g. checkpoint.resume=auto"
            ) from None

    allow_changes: list[str] = Field(
        default_factory=list,
        description="Config keys (or sections) a resume may change although they alter the trajectory.",
    )
    trust_pickles: bool = Field(
        False,
        description="Let DeepSpeed / torch.distributed.checkpoint unpickle a checkpoint that names code beyond "
        "zerofit's allow-list on resume (only for a checkpoint whose source you trust).",
    )
    save_final: bool = True


class WandbSection(_Section):
    """Weights & Biases; mode unset = online if an API key is configured, else offline."""

    mode: Literal["online", "offline", "disabled"] | None = None
    project: str = "zerofit"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    tags: list[str] = Field(default_factory=list)


class MlflowSection(_Section):
    """MLflow (`pip install zerofit[mlflow]`): the run's rows as metrics, its config as parameters, its files
    as artifacts (zerofit.metrics.mlflow_sink)."""

    enabled: bool = False
    tracking_uri: str | None = Field(
        None,
        description="Where runs go; unset: MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db.",
    )
    experiment: str | None = Field(
        None, description="The MLflow experiment; unset: the config file's stem (as W&B's group)."
    )


class LoggingSection(_Section):
    """Where metrics go and how often (metrics.jsonl is always written)."""

    log_every: int = Field(1, gt=0)
    console: bool = True
    wandb: WandbSection = Field(default_factory=WandbSection)
    tensorboard: bool = Field(
        False,
        description="TensorBoard event files in <run_dir>/tensorboard/ (pip install zerofit[tensorboard]).",
    )
    mlflow: MlflowSection = Field(default_factory=MlflowSection)


class PlannerSection(_Section):
    """The GPU a config is written for, for the memory planner (`zerofit plan`, `micro_batch_size=auto`).

    At launch a visible CUDA device wins; these fields are the target when planning away from it.
    """

    gpu: str | None = Field(
        None, description="A GPU in the planner's catalogue, e.g. rtx3090 (see zerofit plan --gpu)."
    )
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="Usable GPU memory in GiB (overrides planner.gpu)."
    )
    num_gpus: int = Field(
        1, ge=1, description="How many GPUs (data-parallel ranks) the config is written for."
    )
    headroom: Annotated[float, RuleHint("a fraction of GPU memory, e.g. 0.05")] = Field(
        0.05, ge=0, lt=1, description="Fraction of GPU memory kept free beyond the planner's allowance."
    )


RLLossType = Literal["grpo", "dapo", "dr_grpo"]  # rl.loss_type (see zerofit.objectives.grpo.loss)
RewardScaling = Literal["group", "batch", "none"]  # rl.scale_rewards
ImportanceLevel = Literal["token", "sequence", "sequence_token"]  # rl.importance_sampling_level (GSPO)


class RewardSpec(_Section):
    """One reward function of an online-RL run (`rl.rewards`): a built-in by name, or the user's own
    `module:function`, imported only because the user's own config or command line names it."""

    function: str = Field(
        description="A built-in reward (exact_match, format_regex, length, reward_model) or `module:function` "
        "(called with prompts, completions and the data's other columns; returns one float per completion)."
    )
    weight: float = Field(1.0, description="Its weight in the summed reward.")
    column: str = Field("answer", description="exact_match: the data column holding the reference answer.")
    pattern: str | None = Field(
        None, description="format_regex: the regular expression a completion must match."
    )
    target_length: int | None = Field(
        None, gt=0, description="length: the completion length (tokens) that earns the full reward."
    )
    path: str | None = Field(
        None,
        description="reward_model: a sequence-classification model folder (`zerofit export` of a reward run).",
    )


class ToolSpec(_Section):
    """One tool an agentic GRPO run offers the policy (`rl.tools`): a built-in by name, or the user's own
    `module:function`, imported only because the user's own config or command line names it."""

    function: str = Field(
        description="A built-in tool (calculator, lookup) or `module:function` (type hints and a Google-style "
        "docstring, from which its JSON schema is built)."
    )
    column: str = Field(
        "table", description="lookup: the data column holding the row's table (key -> value)."
    )


class RLSection(_Section):
    """Online RL (`train.objective: grpo` or `rloo`): rollouts generated inside the run, scored by reward
    functions, and the clipped policy-gradient loss of GRPO and its published variants (TRL GRPOConfig's
    names), or RLOO's (TRL RLOOConfig's)."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (G): one group.")
    prompts_per_step: int = Field(
        4, ge=1, description="Prompts per optimizer step (the global batch, in groups)."
    )
    max_prompt_length: int = Field(
        256, gt=0, description="Longer prompts are refused or truncated (data.truncation)."
    )
    max_completion_length: int = Field(
        128, gt=0, description="Generation stops here; such a completion is truncated."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: 1.0 is off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling: 0 is off.")
    loss_type: RLLossType = Field(
        "dapo",
        description="grpo: each completion's token mean, then the mean over completions; dapo: the token mean "
        "over the global batch's completion tokens; dr_grpo: the token sum over max_completion_length x "
        "completions.",
    )
    beta: float = Field(
        0.0, ge=0, description="KL to the reference (k3 estimator); 0 skips the reference pass."
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="TRL's: the k3 term times the probability ratio (unbiased reverse-KL gradient); false is "
        "the original GRPO's k3.",
    )
    importance_sampling_level: ImportanceLevel = Field(
        "token",
        description="The ratio per token (GRPO), per completion (sequence: GSPO, the geometric mean of its token "
        "ratios) or GSPO-token (sequence_token: the sequence's value, a per-token gradient).",
    )
    epsilon: float = Field(0.2, gt=0, description="The ratio's lower clipping bound, 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0, description="The upper bound, 1 + epsilon_high (DAPO: 0.28)."
    )
    num_iterations: int = Field(
        1, ge=1, description="Updates per generation batch (old-policy log-probs kept)."
    )
    scale_rewards: RewardScaling = Field(
        "group", description="Advantages divided by the std of the group, of the batch, or not at all."
    )
    normalize_advantages: bool = Field(
        False,
        description="train.objective rloo: the leave-one-out advantages normalized over the global batch (mean "
        "0, std 1; TRL RLOOConfig's).",
    )
    mask_truncated_completions: bool = Field(
        False, description="Truncated completions count in no loss term."
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list, description="The reward functions, summed by weight."
    )
    generation_backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers: the policy's own generate; vllm: colocated vLLM (CUDA)."
    )
    log_completions_every: int = Field(
        10,
        ge=0,
        description="Every N steps a few sampled completions go to completions.jsonl in the run folder; 0 never.",
    )
    tools: list[ToolSpec] = Field(
        default_factory=list,
        description="Tools the policy may call: multi-turn rollouts (docs/guides/agents.md).",
    )
    environment: str | None = Field(
        None, description="`module:Class`: an environment that answers each assistant turn (agents guide)."
    )
    max_turns: int = Field(
        3, ge=1, description="With tools or an environment: the most assistant turns of one trajectory."
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="A tool call running longer is answered with an error."
    )


class GKDSection(_Section):
    """On-policy distillation (`train.objective: gkd`, GKD of Agarwal et al. 2024): the student learns the
    teacher's per-token distribution on its own samples (TRL GKDConfig's names and defaults; the prompts,
    completion lengths and sampling are the `rl` section's keys)."""

    teacher: str | None = Field(
        None,
        description="The teacher: a built-in, a hub id, a model folder, a zerofit run or export; it must share "
        "the student's tokenizer.",
    )
    teacher_load_in: Literal["none", "8bit", "4bit"] = Field(
        "none", description="Load the teacher's linear weights quantized (bitsandbytes, CUDA only)."
    )
    beta: float = Field(
        0.5, ge=0, le=1, description="Generalized JSD's interpolation: 0 forward KL, 1 reverse KL."
    )
    lmbda: float = Field(
        0.5, ge=0, le=1, description="On-policy fraction: 0 the data's completions, 1 the student's samples."
    )
    seq_kd: bool = Field(
        False, description="Off-policy completions are sampled by the teacher instead of read from the data."
    )


SEED_MAX = 2**32 - 1  # numpy.random.seed (through accelerate's set_seed) takes 0 .. 2**32 - 1


class ZerofitConfig(_Section):
    """A whole run. Load with `zerofit.config.load_config`, then `resolve()` before use."""

    run_name: str | None = Field(None, description="Default says model/method/preset/split.")
    output_dir: str = "runs"

    @field_validator("run_name")
    @classmethod
    def _one_folder_name(cls, value: str | None) -> str | None:
        """A run name is one path component under output_dir: `../victim`, `/tmp/x` or `` would write
        outside this run's folder (into another run's config.yaml and metrics.jsonl)."""
        problem = None if value is None else run_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    seed: Annotated[int, RuleHint("numpy's seeding takes 0 to 2**32 - 1")] = Field(42, ge=0, le=SEED_MAX)
    model: ModelSection = Field(default_factory=ModelSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    batch: BatchSection = Field(default_factory=BatchSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    train: TrainSection = Field(default_factory=TrainSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    rl: RLSection = Field(default_factory=RLSection)
    gkd: GKDSection = Field(default_factory=GKDSection)
    kto: KTOSection = Field(default_factory=KTOSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    planner: PlannerSection = Field(default_factory=PlannerSection)

    # The dotted keys the command line set (recorded by `load_config`), so that `resolve()` can let an
    # override win over a file value it contradicts (`distributed.strategy=fsdp` on a config with a DeepSpeed
    # preset). Not a config key: never validated, dumped or written to config.yaml.
    _overrides: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @property
    def overridden(self) -> frozenset[str]:
        """Dotted keys set by command-line overrides rather than the config file."""
        return self._overrides

    def mark_overridden(self, keys: frozenset[str]) -> None:
        """Record which dotted keys came from the command line (see `overridden`)."""
        self._overrides = frozenset(keys)
