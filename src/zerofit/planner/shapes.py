"""Exact parameter counts and layer shapes of a model, from a meta-device build of its config (no weights).

The memory model needs more than a parameter total: which linear layers a decoder layer has (their in/out
features decide activation and LoRA sizes), how many parameters sit outside the layers (embeddings, final
norm, lm_head), and exactly how many parameters LoRA adds. All of it comes from building the real
transformers model class on `torch.device("meta")` (no memory, milliseconds) and, for LoRA, applying peft to
a meta build too, so counts are exact for any architecture transformers knows, including biases, GQA and
DoRA magnitude vectors. Family facts come from the build too: every RMSNorm of a layer, the sliding window
and its layers, soft-capping, tied embeddings, and a mixture of experts' routed experts (transformers 5
stores a layer's experts as fused 3-D parameters, not `nn.Linear`s) and what peft adapts among them.

LoRA is applied to 1- and 2-layer builds and extrapolated (decoder layers of these models are identical), which
keeps a 7B count well under a second. Results are cached in-process and on disk (`$ZEROFIT_CACHE/planner/`,
`zerofit.core.derived_cache`: keyed by the config, the settings, the library versions and zerofit's source,
each entry checked before use), so only the first plan of a model imports transformers' modeling stack and
peft; every later one reads the entries (tests/unit/test_lazy_imports.py). The entries of a family
`zerofit.catalogue.layouts` reads (dense, Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen2-VL / Qwen2.5-VL) come from its
config alone, before the cache (`zerofit.planner.config_shapes`, equal to the build's field by field): its
first plan builds nothing.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, TypedDict

from zerofit.catalogue.models import model_config_dict
from zerofit.core.derived_cache import cache_key, conforms, read_cache, write_cache
from zerofit.levers.layers import decoder_layers, decoder_layers_prefix
from zerofit.models.meta import build_meta_model
from zerofit.planner.config_shapes import lora_entry, shape_entry

# The layout of the cached entries (`zerofit.core.derived_cache`; the key also holds zerofit's source digest).
_CACHE_VERSION = 6


@dataclass(frozen=True)
class LinearShape:
    """One linear layer inside a decoder layer: its module name (e.g. `self_attn.q_proj`) and size."""

    name: str
    in_features: int
    out_features: int
    bias: bool

    @property
    def params(self) -> int:
        """Weight (+ bias) element count."""
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """A causal LM's dimensions and exact parameter counts, split where the memory model needs it."""

    name_or_path: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    total_params: int
    layer_params: int  # parameters of one decoder layer
    layer_linear_weight_params: int  # the quantizable part of one layer: linear weights (no biases)
    embed_params: int
    lm_head_params: int  # 0 when tied to the embeddings
    other_params: int  # everything else outside the layers (final norm, ...)
    linears: tuple[LinearShape, ...]  # the linear layers of one decoder layer, in forward order
    layer_param_numels: tuple[int, ...]  # element count of each parameter tensor of one decoder layer
    outside_param_numels: tuple[int, ...]  # ... and of each parameter tensor outside the layers
    # The RMSNorms of one decoder layer, in forward order: (name, width of its input per token, rows per
    # token it normalises). Llama: 2 norms of `hidden`; Qwen3 and Gemma 3 add q/k norms over each head
    # (q_dim / kv_dim wide, one rstd per head); Gemma 2/3 have 4 norms of `hidden` per layer.
    norms: tuple[tuple[str, int, int], ...] = ()
    # Mixture of experts (0 experts: a dense model): experts per MoE layer, routed per token, an expert's
    # MLP width, the shared expert's width (0: none), and the expert parameters of one layer (all resident).
    # Gemma 2's soft-capping (0: none): cap * tanh(x / cap) of the attention scores (eager only) and of the
    # final logits; each tanh keeps its output for backward.
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Sliding-window attention: the window (0: none) and how many of the layers use it.
    sliding_window: int = 0
    sliding_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    layer_expert_params: int = 0
    # A vision-language model (0: a language model): the vision tower's parameters (patch embedding and
    # blocks) and the projector's, both part of `total_params` and `other_params`; the fields above are its
    # language model's.
    vision_params: int = 0
    projector_params: int = 0

    @property
    def is_vision(self) -> bool:
        """A vision-language model (a vision tower in front of the language model)."""
        return self.vision_params > 0

    @property
    def layer_mlp_weight_params(self) -> int:
        """Linear weights of one layer's MLP (gate, up, down: what a tiled MLP's extra forward runs)."""
        mlp = ("gate_proj", "up_proj", "down_proj")
        return sum(lin.in_features * lin.out_features for lin in self.linears if lin.name.endswith(mlp))

    @property
    def param_numels(self) -> tuple[int, ...]:
        """Element count of every parameter tensor of the model (per-tensor optimizer rules need them)."""
        return self.layer_param_numels * self.num_layers + self.outside_param_numels

    @property
    def layer_active_matmul_params(self) -> int:
        """Matmul weights one token runs through in a decoder layer: the linears, plus under MoE only the
        k routed experts (of all resident) and the router (E x h): what the speed model counts."""
        if not self.is_moe:
            return self.layer_linear_weight_params
        routed = self.layer_expert_params * self.experts_per_token // self.num_experts
        return self.layer_linear_weight_params + routed + self.num_experts * self.hidden_size

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model (its MLP is routed experts, not one SwiGLU)."""
        return self.num_experts > 0

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection: kv heads x head dim (GQA makes it < hidden)."""
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of the query projection (= attention output width)."""
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class LoraShape:
    """What LoRA adds to a model: exact trainable count, per-layer targets and each adapter tensor's size."""

    r: int
    target_modules: tuple[str, ...] | str
    use_dora: bool
    trainable_params: int
    layer_trainable_params: int
    outside_trainable_params: int  # adapters on modules outside the decoder layers (e.g. lm_head if targeted)
    layer_targets: tuple[LinearShape, ...]  # base linears of one decoder layer that carry an adapter
    # Element counts of every trainable tensor of the whole model (for per-tensor optimizer rules such as
    # bitsandbytes' "8-bit state only for tensors of >= 4096 elements").
    tensor_numels: tuple[int, ...]
    # Parameters (not `nn.Linear`s) peft adapts in one layer through `target_parameters`, as
    # (module, parameter, numel): a MoE's fused 3-D expert weights and its router's weight, which peft
    # 0.21 targets for `all-linear` on transformers 5 Mixtral / Qwen3-MoE. Their merged weight W + BA is
    # rebuilt in every forward (one full-size copy per layer, saved for backward).
    adapted_params: tuple[tuple[str, str, int], ...] = ()
    # Trainable elements of one layer's expert-weight adapters (their lora_A / lora_B factors): part of
    # `layer_trainable_params`, whose gradients come from the merged weight's, not from the tokens.
    layer_expert_factor_params: int = 0

    @property
    def experts_adapted(self) -> bool:
        """True when the experts' 3-D weights carry an adapter (each layer saves their merged copy)."""
        return any(module.endswith("experts") for module, _, _ in self.adapted_params)

    @property
    def router_adapted(self) -> bool:
        """True when the router's weight carries an adapter (the router then saves its input)."""
        return any(not module.endswith("experts") for module, _, _ in self.adapted_params)

    @property
    def merged_expert_numel(self) -> int:
        """Elements of the merged expert weights one layer rebuilds per forward."""
        return sum(n for module, _, n in self.adapted_params if module.endswith("experts"))


def _linears_of(layer: Any) -> tuple[LinearShape, ...]:
    import torch

    found = []
    for name, module in layer.named_modules():
        if type(module) is torch.nn.Linear:
            found.append(LinearShape(name, module.in_features, module.out_features, module.bias is not None))
    return tuple(found)


def _norms_of(layer: Any, q_dim: int, kv_dim: int, head_dim: int) -> tuple[tuple[str, int, int], ...]:
    """Every RMSNorm of a decoder layer: (name, input width per token, rstd rows per token). A norm whose
    weight is head_dim wide normalises each head of q (or k): its input per token is q_dim (kv_dim) wide."""
    found = []
    for name, module in layer.named_modules():
        weight = getattr(module, "weight", None)
        if "Norm" not in type(module).__name__ or weight is None or weight.dim() != 1:
            continue
        width = weight.numel()
        if width == head_dim and name.rpartition(".")[2].startswith(("q_", "k_")):
            per_token = q_dim if name.rpartition(".")[2].startswith("q_") else kv_dim
            found.append((name, per_token, per_token // head_dim))
        else:
            found.append((name, width, 1))
    return tuple(found)


def _moe_fields(layer: Any, cfg: Any) -> dict[str, int]:
    """The routed-experts facts of a decoder layer (all zero for a dense layer): the experts module's 3-D
    parameters (transformers 5 stores every expert of a layer fused, not as `nn.Linear`s)."""
    experts = next((m for n, m in layer.named_modules() if n.endswith("experts")), None)
    if experts is None:
        return {}
    num = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0)
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    return {
        "num_experts": num,
        "experts_per_token": cfg.num_experts_per_tok,
        "expert_intermediate_size": getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
        "shared_expert_intermediate_size": shared,
        "layer_expert_params": sum(p.numel() for p in experts.parameters()),
    }


def _sliding_fields(cfg: Any, num_layers: int) -> dict[str, int]:
    """The sliding window and how many layers attend through it (per-layer `layer_types` where the family
    mixes local and global layers, Gemma 2/3; else every layer when a window is set, Mistral v0.1, Phi-3)."""
    window = getattr(cfg, "sliding_window", None) or 0
    if not window:
        return {}
    types = getattr(cfg, "layer_types", None)
    sliding = sum(t == "sliding_attention" for t in types) if isinstance(types, list) else num_layers
    return {"sliding_window": window, "sliding_layers": sliding}


def text_model(model: Any) -> Any:
    """The part whose decoder layers the planner counts: a vision-language model's language model (its vision
    blocks are counted apart, `_vision_fields`), else the model itself. Works through a peft wrapper."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hf.get_decoder() if hasattr(hf.config, "vision_config") else model


def text_layers_prefix(model: Any) -> str:
    """`decoder_layers_prefix` of the language model's layers, as named in `model` (a vision-language
    model's vision blocks come first among its `decoder_layers`)."""
    first = decoder_layers(text_model(model))[0]
    return next(name for name, module in model.named_modules() if module is first).rpartition(".")[0] + "."


def _vision_fields(model: Any) -> dict[str, int]:
    """A vision-language model's vision tower and projector parameters (everything outside the language
    model and lm_head; the projector by its family's module name, `zerofit.models.vision.FAMILIES`)."""
    if not hasattr(model.config, "vision_config"):
        return {}
    from zerofit.models.vision import vision_family

    head = model.get_output_embeddings()
    language = {id(p) for p in text_model(model).parameters()} | {id(head.weight)}
    outside = [(n, p.numel()) for n, p in model.named_parameters() if id(p) not in language]
    family = vision_family(model.config.to_dict())
    projector = sum(n for name, n in outside if family and re.match(family.projector, name))
    return {"vision_params": sum(n for _, n in outside) - projector, "projector_params": projector}


def compute_model_shape(name_or_path: str) -> ModelShape:
    """Exact shapes measured on a meta-device build of the whole model (seconds: the imports)."""
    model = build_meta_model(name_or_path, attn_implementation="eager")  # shapes only: any attention
    cfg = model.config.get_text_config()  # a vision-language model: its language model's
    layers = decoder_layers(text_model(model))
    prefix = decoder_layers_prefix(model) if not layers else text_layers_prefix(model)
    layer = layers[0]
    layer_params = sum(p.numel() for p in layer.parameters())
    linears = _linears_of(layer)
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    head_params = 0 if tied else head.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    num_layers = len(layers)
    other = total - num_layers * layer_params - embed - head_params
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return ModelShape(
        name_or_path=name_or_path,
        model_type=cfg.model_type,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=tied,
        total_params=total,
        layer_params=layer_params,
        layer_linear_weight_params=sum(lin.in_features * lin.out_features for lin in linears),
        embed_params=embed,
        lm_head_params=head_params,
        other_params=other,
        linears=linears,
        layer_param_numels=tuple(p.numel() for p in layer.parameters()),
        outside_param_numels=tuple(
            p.numel() for n, p in model.named_parameters() if not n.startswith(prefix)
        ),
        norms=_norms_of(layer, heads * head_dim, kv_heads * head_dim, head_dim),
        **_moe_fields(layer, cfg),
        **_sliding_fields(cfg, num_layers),
        attn_logit_softcapping=getattr(cfg, "attn_logit_softcapping", None) or 0.0,
        final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None) or 0.0,
        **_vision_fields(model),
    )


@lru_cache(maxsize=64)
def model_shape(name_or_path: str) -> ModelShape:
    """Exact dimensions and parameter counts of `name_or_path` (catalogue id or local HF folder)."""
    config = model_config_dict(name_or_path)
    cached = shape_entry(config, name_or_path)  # a family `catalogue.layouts` reads: from its config alone
    key = cache_key("model", _CACHE_VERSION, {"config": config})
    cached = cached if cached is not None else read_cache(key)
    if cached is not None and conforms(cached, ModelShape):  # an entry is data: checked before use
        return shape_of_entry(cached, name_or_path)
    shape = compute_model_shape(name_or_path)
    write_cache(key, asdict(shape))
    return shape


def shape_of_entry(entry: dict[str, Any], name_or_path: str) -> ModelShape:
    """The `ModelShape` an entry (JSON form: a cached one, or `config_shapes.shape_entry`'s) holds."""
    fields = {**entry, "name_or_path": name_or_path}
    fields["linears"] = tuple(LinearShape(**lin) for lin in entry["linears"])
    fields["layer_param_numels"] = tuple(entry["layer_param_numels"])
    fields["outside_param_numels"] = tuple(entry["outside_param_numels"])
    fields["norms"] = tuple(tuple(n) for n in entry["norms"])
    return ModelShape(**fields)


def _lora_counts(
    name_or_path: str,
    num_layers: int,
    r: int,
    targets: Any,
    use_dora: bool,
    moe: tuple[str, bool],
    vision: tuple[str, bool] | None = None,
) -> dict[str, Any]:
    from zerofit.models.lora import apply_lora, lora_config
    from zerofit.models.vision import apply_vision_lora

    meta = build_meta_model(name_or_path, num_layers, attn_implementation="eager")
    spec = lora_config(r, 2 * r, 0.0, targets, use_dora, *moe)
    # A vision-language model: adapters where training puts them (`lora.projector`, `lora.vision_tower`).
    model = apply_vision_lora(meta, spec, *vision, None)[0] if vision else apply_lora(meta, spec)
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    if vision:  # name the language model's layers `.layers.N.` and nothing else (a CLIP tower's are too)
        prefix = text_layers_prefix(model)
        trainable = [(n.replace(prefix, ".layers.") if n.startswith(prefix) else n.replace(".layers.", "."), k)
                     for n, k in trainable]  # fmt: skip
    layer0 = decoder_layers(text_model(model))[0]
    layer_targets = []
    for name, module in layer0.named_modules():
        base = getattr(module, "base_layer", None)
        if base is not None and hasattr(module, "lora_A") and hasattr(base, "in_features"):
            bias = getattr(base, "bias", None) is not None
            layer_targets.append(LinearShape(name, base.in_features, base.out_features, bias))
    adapted = _adapted_params(layer0)
    factors = sum(
        p.numel()
        for name, module in layer0.named_modules()
        if getattr(module, "parameter_name", None) is not None
        and name.replace(".base_layer", "").endswith("experts")
        for p in (*module.lora_A.parameters(), *module.lora_B.parameters())
    )
    # A router trained in full (lora.train_router: peft's modules_to_save) needs its input saved, as an
    # adapted one does: recorded as an adapted parameter of the router module.
    adapted += [
        (n.split(".modules_to_save")[0].split(".layers.0.")[-1], "weight", p.numel())
        for n, p in layer0.named_parameters(prefix=f"{decoder_layers_prefix(model)}0")
        if p.requires_grad and ".modules_to_save." in n
    ]
    return {
        "trainable": trainable,
        "layer_targets": layer_targets,
        "adapted_params": adapted,
        "expert_factor_params": factors,
    }


def _adapted_params(layer: Any) -> list[tuple[str, str, int]]:
    """(module, parameter, numel) of every parameter peft wraps (`ParamWrapper`) in a decoder layer; the
    module name is the wrapped module's, without peft's `base_layer` hops."""
    found = []
    for name, module in layer.named_modules():
        param_name = getattr(module, "parameter_name", None)
        if param_name is None or not hasattr(module, "lora_A"):
            continue
        base = module.get_base_layer()
        numel = getattr(base, param_name).numel() if hasattr(base, param_name) else 0
        found.append((name.replace(".base_layer", ""), param_name, numel))
    return found


class _LoraEntry(TypedDict):
    """A cached LoRA count (`_lora_shape_cached`): per layer and outside the layers."""

    layer_trainable_params: int
    outside_trainable_params: int
    layer_targets: list[LinearShape]
    layer_numels: list[int]
    outside_numels: list[int]
    adapted_params: list[tuple[str, str, int]]
    expert_factor_params: int


def built_lora_entry(
    name_or_path: str,
    r: int,
    targets: tuple[str, ...] | str,
    use_dora: bool,
    moe: tuple[str, bool],
    vision: tuple[str, bool] | None = None,
) -> dict[str, Any]:
    """A `_LoraEntry` measured by peft on 1- and 2-layer meta-device builds (seconds: the imports)."""
    one = _lora_counts(name_or_path, 1, r, targets, use_dora, moe, vision)
    two = _lora_counts(name_or_path, 2, r, targets, use_dora, moe, vision)
    t1 = sum(n for _, n in one["trainable"])
    t2 = sum(n for _, n in two["trainable"])
    per_layer = t2 - t1
    return {
        "layer_trainable_params": per_layer,
        "outside_trainable_params": t1 - per_layer,
        "layer_targets": [asdict(t) for t in one["layer_targets"]],
        "layer_numels": [n for name, n in one["trainable"] if ".layers.0." in name],
        "outside_numels": [n for name, n in one["trainable"] if ".layers." not in name],
        "adapted_params": [list(a) for a in one["adapted_params"]],
        "expert_factor_params": one["expert_factor_params"],
    }


@lru_cache(maxsize=128)
def _lora_shape_cached(
    name_or_path: str,
    r: int,
    targets: tuple[str, ...] | str,
    use_dora: bool,
    moe: tuple[str, bool],
    vision: tuple[str, bool] | None = None,
) -> LoraShape:
    shape = model_shape(name_or_path)
    payload = {"config": model_config_dict(name_or_path), "r": r, "targets": targets, "dora": use_dora}
    payload["moe"] = list(moe)
    payload["fields"] = 2  # entries also hold expert_factor_params (older ones are not read)
    if vision:
        payload["vision"] = list(vision)
    key = cache_key("lora", _CACHE_VERSION, payload)
    cached = lora_entry(payload["config"], r, targets, use_dora, moe, vision)  # from the config alone
    cached = cached if cached is not None else read_cache(key)
    if cached is None or not conforms(cached, _LoraEntry):  # an entry is data: checked before use
        cached = built_lora_entry(name_or_path, r, targets, use_dora, moe, vision)
        write_cache(key, cached)
    per_layer = cached["layer_trainable_params"]
    outside = cached["outside_trainable_params"]
    numels = tuple(cached["layer_numels"]) * shape.num_layers + tuple(cached["outside_numels"])
    return LoraShape(
        r=r,
        target_modules=targets,
        use_dora=use_dora,
        trainable_params=per_layer * shape.num_layers + outside,
        layer_trainable_params=per_layer,
        outside_trainable_params=outside,
        layer_targets=tuple(LinearShape(**t) for t in cached["layer_targets"]),
        tensor_numels=numels,
        adapted_params=tuple(tuple(a) for a in cached["adapted_params"]),
        layer_expert_factor_params=cached["expert_factor_params"],
    )


def lora_shape(
    name_or_path: str,
    r: int,
    target_modules: Any = "all-linear",
    use_dora: bool = False,
    moe_experts: str = "shared",
    train_router: bool = False,
    projector: str = "frozen",
    vision_tower: bool = False,
) -> LoraShape:
    """Exact LoRA trainable-parameter counts for `name_or_path`, from peft applied to a meta build, with
    `target_modules` mapped for its family and the MoE choices (`zerofit.models.lora_targets`); for a
    vision-language model, with `lora.projector` / `lora.vision_tower` (`zerofit.models.vision`)."""
    targets = target_modules if isinstance(target_modules, str) else tuple(target_modules)
    vision = (projector, vision_tower) if model_shape(name_or_path).is_vision else None
    return _lora_shape_cached(name_or_path, r, targets, use_dora, (moe_experts, train_router), vision)
