"""The memory scenario: everything one training step's memory depends on, derived from the engine spec.

A `Scenario` is a flat, hashable record (model, sequence, split, engine facts, adaptation, numerics) the
analytic model (`state.py`, `activations/`, `estimate.py`) and the tensor trace (`trace.py`) both read.
It is built from the run's rendered engine spec (`scenario_for`), so the planner sees exactly the engine
the run will get: the ZeRO stage, offload, who builds the optimizer and every dtype come from the spec,
never from a second reading of the preset or of a user's DeepSpeed file. A what-if (a candidate
micro-batch, a remedy, more GPUs) is the same: `what_if` applies its overrides through the config loader's
parser and asks `resolve()` itself, so the planner keeps no second derivation of a run. `ComputeProfile` is
the dtype view of a scenario, from the one precision table (`zerofit.core.precision`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from zerofit.core.precision import dtype_bytes, tensor_dtypes, torch_dtype
from zerofit.levers.recompute import checkpointed_layers
from zerofit.objectives.registry import objective_of
from zerofit.objectives.sft import SFT
from zerofit.objectives.spec import ObjectiveSpec
from zerofit.planner.images import ImageRows, planned_images
from zerofit.planner.rl import RLShape, rl_shape
from zerofit.planner.shapes import LoraShape, lora_shape

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine_spec.spec import EngineSpec


# The MLP token shard counts the planner weighs (1 = off): `train.tiled_mlp: auto` (`search.lever_variants`)
# and `zerofit plan --max-context` (`context.lever_combinations`) try the same ones, so the longest context
# --max-context reports is one a config's `auto` reaches at that `data.max_seq_len`.
TILED_MLP_SHARDS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Scenario:
    """Everything the memory of one training step depends on (built from an engine spec by `scenario_for`)."""

    model: str
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int = 1
    dp_size: int = 1
    sequence_parallel: int = 1  # Ulysses: ranks sharing one sequence (dp_size = world / this)
    strategy: str = "single"  # single | ddp | deepspeed | fsdp
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    ds_builds_optimizer: bool = False  # DeepSpeed's own (CPU) Adam instead of the client optimizer
    fsdp_cpu_offload: bool = False
    precision: str = "bf16"
    lora: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | str = "all-linear"
    use_dora: bool = False
    # Mixture of experts (lora.moe_experts, lora.train_router; zerofit.models.lora_targets): which experts adapt
    # (`all`: every routed expert through peft's target_parameters) and whether the router trains in full.
    lora_moe_experts: str = "shared"
    lora_train_router: bool = False
    # Vision-language models (lora.projector, lora.vision_tower; zerofit.models.vision): the projector frozen or
    # trained in full, LoRA on the vision tower's linears too. `images`: the image tokens of the planned
    # micro-batch (`zerofit.planner.images`); None for a language model.
    lora_projector: str = "frozen"
    lora_vision_tower: bool = False
    images: ImageRows | None = None
    quantization: str = "none"  # none | 8bit | 4bit
    double_quant: bool = True
    optimizer: str = "adamw"
    # true (every decoder layer), false, or how many of the first layers are recomputed in backward.
    activation_checkpointing: bool | int = False
    attn_implementation: str = "sdpa"  # sdpa | eager | varlen (resolved: never auto)
    # The varlen path's kernel on the planned GPU (`zerofit.levers.attention.KERNELS`; None unless varlen).
    varlen_kernel: str | None = None
    cross_entropy: str = (
        "chunked"  # chunked | unchunked | liger | fused_linear (zerofit.token_loss.sums, fused_loss)
    )
    # Long-context levers: token shards of each MLP (1 = off, zerofit.levers.tiling), the checkpointed
    # inputs kept in pinned host memory (zerofit.levers.offload), and under k-bit quantization whether the
    # residual stream (norms, embeddings, lm_head) is upcast to fp32 (quantization.fp32_residual); the
    # RMSNorms saving their input as it is instead of its fp32 upcast (train.lean_norm, zerofit.levers.norms).
    tiled_mlp: int = 1
    activation_offload: bool = False
    fp32_residual: bool = True
    lean_norm: bool = False
    # Opt-in speed levers: train.kernels (none | liger) and train.compile; their speed factors
    # are speed.py's stated constants. Liger's RMSNorm saves what the lean norm saves (`lean_norm` is set
    # for it); its SwiGLU saves less than the eager MLP, which the memory model does not count (an upper bound).
    kernels: str = "none"
    compile: bool = False
    # Token budget: micro_batch_size rows of seq_len tokens, each packing whole examples (attention is
    # masked per document, so always the masked path).
    packed: bool = False
    # Preference tuning (train.objective dpo / simpo / orpo): a micro-batch of `micro_batch_size` pairs is
    # one forward of twice as many sequences (`rows`). `reference` (preference.reference, resolved):
    # `adapters_off` adds a no-grad forward of those rows per micro-step with the LoRA adapters off;
    # `precomputed` costs nothing in training (a one-time pass before it), `none` has no reference.
    # KTO (train.objective kto): a micro-batch of `micro_batch_size` examples is one forward of as many rows,
    # plus three no-grad forwards of them per micro-step (`no_grad_forwards`): the reference (adapters off),
    # and the policy and the reference on the mismatched (KL) sequences before the window.
    objective: ObjectiveSpec = SFT
    reference: str = "none"
    # Online RL (train.objective grpo; zerofit.planner.rl): the rank's rollout, generated before training on
    # micro-batches of `micro_batch_size` completions of `seq_len` = prompt + completion tokens.
    rl: RLShape | None = None
    # On-policy distillation (train.objective gkd; zerofit.planner.teacher): the frozen teacher every rank
    # holds beside the policy (gkd.teacher) and how its linear weights load (gkd.teacher_load_in).
    teacher: str | None = None
    teacher_load_in: str = "none"
    # None = what the strategy does (autocast for single/ddp in bf16/fp16). False reproduces a plain step
    # without autocast (how the 7B reference figures in docs/platform.md were measured).
    autocast: bool | None = None

    @property
    def image_tokens(self) -> int:
        """Image tokens of the planned micro-batch (its rows with the most; 0 for a language model)."""
        return self.images.micro_batch(self.rows) if self.images is not None else 0

    def lora_shape(self) -> LoraShape:
        """The adapters this scenario trains: `shapes.lora_shape` of its LoRA settings (one home for the
        memory, activation and speed terms)."""
        return lora_shape(
            self.model,
            self.lora_r,
            self.lora_targets,
            self.use_dora,
            self.lora_moe_experts,
            self.lora_train_router,
            self.lora_projector,
            self.lora_vision_tower,
        )

    def with_micro(self, micro: int, grad_accum_steps: int) -> Scenario:
        """The same run at another micro-batch size (and the accumulation that keeps the global batch)."""
        return replace(self, micro_batch_size=micro, grad_accum_steps=grad_accum_steps)

    def with_checkpointing(self, layers: bool | int) -> Scenario:
        """The same run with another `train.activation_checkpointing` (true, false or a layer count)."""
        return replace(self, activation_checkpointing=layers)

    def with_levers(self, **levers: Any) -> Scenario:
        """The same run with other long-context levers (`tiled_mlp`, `activation_offload`, `cross_entropy`,
        `fp32_residual`, `lean_norm`, `seq_len`, `activation_checkpointing`)."""
        return replace(self, **levers)

    @property
    def zero_ranks(self) -> int:
        """Ranks ZeRO partitions over: every rank (DeepSpeed's sequence-data-parallel group), dp x N."""
        return max(self.dp_size, 1) * self.sequence_parallel

    @property
    def shard_seq_len(self) -> int:
        """Positions of one rank's sequence shard: the sequence padded to a multiple of N, over N."""
        return -(-self.seq_len // self.sequence_parallel)

    def checkpointed(self, num_layers: int) -> int:
        """How many of the model's `num_layers` decoder layers are checkpointed."""
        return checkpointed_layers(self.activation_checkpointing, num_layers)

    @property
    def rows(self) -> int:
        """Sequences one micro-step's forward runs on: the micro-batch, or both sequences of its pairs; packed
        (a token budget), its rows (a pair's two sequences get two when they share none)."""
        if self.packed:
            return max(self.micro_batch_size, self.objective.unit.rows)
        return self.micro_batch_size * self.objective.unit.rows

    @property
    def pairs(self) -> bool:
        """The micro-batch counts pairs (`rows` = 2 x pairs)."""
        return self.objective.unit.rows == 2

    @property
    def reference_forward(self) -> bool:
        """Each micro-step also runs the reference: the same rows through the base, adapters off, no grad."""
        return self.reference == "adapters_off"

    @property
    def no_grad_forwards(self) -> int:
        """No-grad forwards of the micro-batch's rows per micro-step besides the policy's: DPO's reference
        (adapters_off), KTO's reference and its KL pass through the policy and the reference."""
        return self.objective.no_grad_forwards(self.reference)

    @property
    def masked_attention(self) -> bool:
        """Attention takes the masked path: a padded micro-batch of several sequences (a pair's two
        sequences included), or packed rows (the documents of a varlen run; sdpa / eager then build a dense
        mask)."""
        return self.rows > 1 or self.packed

    @property
    def dense_mask(self) -> bool:
        """sdpa builds a dense (B, 1, S, S) boolean mask (and an additive one per layer): masked, not varlen."""
        return self.masked_attention and self.attn_implementation == "sdpa"


@dataclass(frozen=True)
class ComputeProfile:
    """Dtypes the engine computes and stores in: the scenario's view of `zerofit.core.precision`'s rule."""

    load: str  # dtype from_pretrained loads in
    half: str | None  # bf16/fp16 when training in half precision
    autocast: bool  # single/ddp: torch.autocast around forward and backward
    cast_params_to: str | None  # DeepSpeed / FSDP2 in half precision: every parameter computes in this dtype
    traced_optimizer: bool  # the optimizer is a torch AdamW the trace can run
    grads_leave_autograd: bool  # the engine moves each gradient into its own (partitioned) buffer at once

    @property
    def half_bytes(self) -> int:
        """Bytes per element of the dtype the run computes in: `half`, or fp32 without one."""
        return dtype_bytes(self.half or "fp32")

    @property
    def load_dtype(self) -> Any:
        """`load` as a torch dtype."""
        return torch_dtype(self.load)

    @property
    def half_dtype(self) -> Any:
        """`half` as a torch dtype (None in fp32)."""
        return torch_dtype(self.half) if self.half else None

    @property
    def cast_dtype(self) -> Any:
        """`cast_params_to` as a torch dtype (None when the engine casts nothing)."""
        return torch_dtype(self.cast_params_to) if self.cast_params_to else None


def compute_profile(scn: Scenario) -> ComputeProfile:
    """The engine's dtypes for `scn`, from the one precision table."""
    dtypes = tensor_dtypes(scn.precision, scn.strategy, lora=scn.lora)
    autocast = dtypes.autocast is not None
    if scn.autocast is not None:
        autocast = scn.autocast and dtypes.half is not None
    fsdp_sync_each = scn.strategy == "fsdp" and (scn.grad_accum_steps == 1 or scn.fsdp_cpu_offload)
    return ComputeProfile(
        load=dtypes.load,
        half=dtypes.half,
        autocast=autocast,
        cast_params_to=dtypes.half_cast,
        traced_optimizer=scn.strategy in ("single", "ddp") and scn.optimizer == "adamw",
        grads_leave_autograd=(scn.strategy == "deepspeed" and scn.zero_stage >= 2) or fsdp_sync_each,
    )


# ------------------------------------------------------------------------------------ scenario from the spec


def _require_resolved(cfg: ZerofitConfig) -> None:
    """ValueError for a config with an `auto` that only `resolve()` (or `what_if`) decides."""
    t = cfg.train
    for key, value in (
        ("train.activation_checkpointing", t.activation_checkpointing),
        ("train.tiled_mlp", t.tiled_mlp),
        ("train.activation_offload", t.activation_offload),
        ("train.lean_norm", t.lean_norm),
        ("train.cross_entropy", t.cross_entropy),
        ("preference.reference", cfg.preference.reference),
    ):
        if value == "auto":
            raise ValueError(f"scenario_for takes a resolved config: {key} is still auto")


def scenario_for(
    config: ZerofitConfig,
    spec: EngineSpec,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
) -> Scenario:
    """The memory scenario of a run: its resolved config's model, data and adaptation, its spec's engine.

    `config` is a resolved one (no `auto` left: `resolve()` or `what_if` decided it). `micro_batch_size` /
    `grad_accum_steps` override the spec's split (the micro-batch search varies them; nothing else about
    the engine depends on the split).
    """
    from zerofit.engine_spec.spec import DeepSpeedSpec, FSDPSpec

    cfg = config
    t = cfg.train
    _require_resolved(cfg)
    plan = spec.batch
    ds = spec if isinstance(spec, DeepSpeedSpec) else None
    objective = objective_of(cfg)
    rl = rl_shape(cfg, objective, plan.dp_size)
    return Scenario(
        model=cfg.model.name_or_path,
        seq_len=rl.seq_len if rl is not None else cfg.data.max_seq_len,
        micro_batch_size=micro_batch_size if micro_batch_size is not None else plan.micro_batch_size,
        grad_accum_steps=grad_accum_steps if grad_accum_steps is not None else plan.grad_accum_steps,
        dp_size=plan.dp_size,
        sequence_parallel=spec.sequence_parallel,
        strategy=spec.strategy,
        zero_stage=ds.zero_stage if ds else 0,
        offload_optimizer=bool(ds and ds.offload_optimizer),
        offload_params=bool(ds and ds.offload_params),
        ds_builds_optimizer=spec.builds_optimizer,
        fsdp_cpu_offload=isinstance(spec, FSDPSpec) and spec.cpu_offload,
        precision=spec.dtypes.precision,
        **_lora_fields(cfg),
        images=planned_images(cfg.model.name_or_path, cfg.data.max_seq_len, cfg.data.max_image_tokens),
        teacher=objective.teacher_model(cfg),
        teacher_load_in=cfg.gkd.teacher_load_in,
        quantization=cfg.quantization.load_in,
        double_quant=cfg.quantization.double_quant,
        optimizer=cfg.optimizer.name,
        activation_checkpointing=cfg.train.activation_checkpointing,
        attn_implementation=cfg.model.attn_implementation,
        varlen_kernel=planned_kernel(cfg, spec.dtypes.precision),
        cross_entropy=t.cross_entropy,
        tiled_mlp=max(1, int(t.tiled_mlp)),
        activation_offload=t.activation_offload is True,
        fp32_residual=cfg.quantization.fp32_residual,
        lean_norm=t.lean_norm is True or t.kernels == "liger",
        kernels=t.kernels,
        compile=t.compile,
        packed=cfg.batch.tokens_per_micro_batch is not None,
        objective=objective,
        # GRPO's reference (rl.beta > 0) is the same no-grad forward with the adapters off as DPO's; KTO's always.
        reference=objective.planned_reference(cfg),
        rl=rl,
    )


def _lora_fields(cfg: ZerofitConfig) -> dict[str, Any]:
    """The Scenario fields of `cfg.lora` (what is adapted, and how)."""
    lora = cfg.lora
    targets = lora.target_modules
    return {
        "lora": lora.enabled,
        "lora_r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "lora_targets": targets if isinstance(targets, str) else tuple(targets),
        "use_dora": lora.use_dora,
        "lora_moe_experts": lora.moe_experts,
        "lora_train_router": lora.train_router,
        "lora_projector": lora.projector,
        "lora_vision_tower": lora.vision_tower,
    }


def planned_kernel(cfg: ZerofitConfig, precision: str) -> str | None:
    """The varlen kernel a resolved run gets on the planned GPU (CUDA, compute capability 8.0+: the cards
    the planner knows run FlashAttention-2 kernels) at the engine's `precision`, by the load's own rule
    (`zerofit.levers.attention.choose_kernel`, with what this install has); None for sdpa / eager."""
    if cfg.model.attn_implementation != "varlen":
        return None
    from zerofit.levers.attention import choose_kernel, installed_kernels

    return choose_kernel(cfg.model.varlen_kernel, "cuda", torch_dtype(precision), (8, 0), installed_kernels())


# ---------------------------------------------------------------------------------------- what-if runs


def apply_overrides(cfg: ZerofitConfig, overrides: Iterable[str]) -> ZerofitConfig:
    """`cfg` with dotted `key=value` overrides applied through the config loader's parser (the command
    line's), keeping what the user set on the command line (`resolve()` reads it to settle the engine)."""
    from zerofit.config.loader import deep_merge, parse_overrides, validate_config

    new = validate_config(deep_merge(cfg.model_dump(), parse_overrides(overrides)))
    new.mark_overridden(cfg.overridden)
    return new


def split_overrides(cfg: ZerofitConfig, world_size: int, micro: int | None, accum: int | None) -> list[str]:
    """Overrides that leave no `auto` in `cfg`'s batch and checkpointing (see `what_if`)."""
    from zerofit.config.rules.engine import data_parallel_size

    b, out = cfg.batch, []
    rows: int | None = micro
    if rows is None and "auto" in (b.micro_batch_size, b.tokens_per_micro_batch):
        rows = 1
    if rows is not None:
        if b.tokens_per_micro_batch is not None:  # a token budget: rows of packed data.max_seq_len tokens
            out += [
                f"batch.tokens_per_micro_batch={rows * cfg.data.max_seq_len}",
                "batch.micro_batch_size=null",
            ]
        else:
            out.append(f"batch.micro_batch_size={rows}")
        if accum is None:
            out.append("batch.grad_accum_steps=null")  # derived from the global batch
        else:
            dp = data_parallel_size(cfg, world_size)  # world / distributed.sequence_parallel
            out += [f"batch.grad_accum_steps={accum}", f"batch.global_batch_size={rows * accum * dp}"]
    t = cfg.train
    if t.activation_checkpointing == "auto":
        out.append("train.activation_checkpointing=true")  # planned as every layer: the smallest peak
    # The levers' `auto` is planned off here; the chooser weighs them on (`search.lever_variants`).
    if t.tiled_mlp == "auto":
        out.append("train.tiled_mlp=false")
    if t.activation_offload == "auto":
        out.append("train.activation_offload=false")
    if t.lean_norm == "auto":
        out.append("train.lean_norm=false")
    if t.cross_entropy == "auto":
        out.append("train.cross_entropy=chunked")
    return out


def what_if(
    cfg: ZerofitConfig,
    world_size: int,
    overrides: Iterable[str] = (),
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
) -> Scenario:
    """The scenario of `cfg` with `overrides`, as `resolve()` itself derives that run: every what-if the
    planner weighs (a candidate micro-batch, a remedy, more GPUs) comes from the one resolution.

    Nothing is `auto` in the candidate (no chooser is asked): `micro_batch_size` rows per micro-batch
    (None: the config's, 1 where it is `auto`), a token budget of rows x data.max_seq_len under one;
    `grad_accum_steps` with the global batch it makes (None: derived from the config's global batch);
    `auto` checkpointing as every layer, `auto` tiling, offload and lean norm off. Raises `ConfigError` when `resolve()` refuses the candidate.
    """
    from zerofit.engine_spec.render import render_spec
    from zerofit.resolution import resolve

    overrides = list(overrides)
    base = apply_overrides(cfg, overrides) if overrides else cfg
    candidate = apply_overrides(base, split_overrides(base, world_size, micro_batch_size, grad_accum_steps))
    resolved = resolve(candidate, world_size)
    return scenario_for(resolved.config, render_spec(resolved))
