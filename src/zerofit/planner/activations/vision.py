"""What a vision-language model's images add to a step: the pixel values, the vision tower's and projector's
saved tensors over the image patches, and (Llama 3.2 Vision) the cross-attention states.

The image tokens themselves are positions of the sequence (`data.max_seq_len` includes them), so the
language model's terms (`layer`, `step`) already count them. On top (`images.ImageRows`: the planned
micro-batch's image tokens; Qwen-VL: merge^2 = 4 patches each):
  - the pixel values (fp32, as the processor makes them) of the micro-batch, held through the step;
  - the tower frozen (the default): it runs before the language model, so its working set is its own moment
    (`tower_forward`): one block's tensors over every patch (fp32 norm input, the residual, q/k/v, the
    SwiGLU's three intermediates) and the image features it hands over. Without checkpointing it saves
    nothing for backward; with it, transformers' `enable_input_require_grads` makes the patch embedding's
    output need a gradient (it hooks every sub-model's input embeddings), so each checkpointed block keeps its
    input and the projector its norm's and GELU's inputs (`_frozen_with_grad`; the trace measures the same);
  - `lora.vision_tower`: every block saves what a decoder layer of its width saves per patch (the same rules,
    `layer.layer_split`, on the block's shape: fused qkv, proj, SwiGLU, two RMSNorms; the adapters on all of
    its linears); with checkpointing (the run checkpoints vision blocks too), each block's input and one
    recomputed block;
  - `lora.projector: full` (or the tower trained): the projector saves its RMSNorm's fp32 input and its MLP's
    inputs (merged tokens x merge^2 hidden: the first linear's input, GELU's input, the second's input);
  - Llama 3.2 Vision: the cross-attention states (image tokens x hidden, half precision) every cross-attention
    layer reads, and each such layer's keys and values of them saved for backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zerofit.planner.activations.dtypes import LayerDtypes, layer_dtypes
from zerofit.planner.activations.layer import layer_split
from zerofit.planner.images import VisionDims, vision_dims
from zerofit.planner.scenario import Scenario, compute_profile
from zerofit.planner.shapes import LinearShape, LoraShape, ModelShape, model_shape


@dataclass(frozen=True)
class VisionTerms:
    """The bytes images add: `held` through the step (label -> bytes) and the tower's own forward moment."""

    held: dict[str, int] = field(default_factory=dict)
    tower_forward: int = 0
    patches: int = 0

    @property
    def held_bytes(self) -> int:
        """Bytes held through forward and backward."""
        return sum(self.held.values())


def block_shape(dims: VisionDims, name: str) -> ModelShape:
    """One vision block as a decoder layer's shape (fused qkv, proj, SwiGLU, two RMSNorms), for `layer_split`."""
    dv, inter = dims.hidden, dims.intermediate
    linears = (
        LinearShape("attn.qkv_proj", dv, 3 * dv, True),
        LinearShape("attn.o_proj", dv, dv, True),
        LinearShape("mlp.gate_proj", dv, inter, True),
        LinearShape("mlp.up_proj", dv, inter, True),
        LinearShape("mlp.down_proj", inter, dv, True),
    )
    weights = sum(lin.in_features * lin.out_features for lin in linears)
    return ModelShape(
        name, "vision", dv, inter, dims.depth, dims.heads, dims.heads, dv // dims.heads, 0, False, 0, 0,
        weights, 0, 0, 0, linears, (), (), norms=(("norm1", dv, 1), ("norm2", dv, 1)),
    )  # fmt: skip


def tower_bytes(scn: Scenario) -> int:
    """Element size of the vision tower's residual stream: the compute dtype (its matmuls run in it, under
    autocast too, so the residual it adds up stays there even when k-bit preparation made its weights fp32;
    measured by the trace)."""
    return compute_profile(scn).half_bytes


def _frozen_with_grad(
    scn: Scenario, dims: VisionDims, dt: LayerDtypes, patches: int, tokens: int
) -> dict[str, int]:
    """The frozen tower under activation checkpointing: transformers' `enable_input_require_grads` (which
    checkpointing turns on) makes every sub-model's input embeddings, the tower's patch embedding too,
    return a tensor that needs a gradient, so each checkpointed vision block keeps its input and the projector
    its RMSNorm's fp32 input and GELU's input, and backward runs through the tower."""
    inputs = dims.depth * patches * dims.hidden * tower_bytes(scn)
    return {
        f"vision blocks' checkpointed inputs ({dims.depth} x {patches} patches; the frozen tower's output "
        "needs a gradient under checkpointing)": inputs,
        f"projector saved inputs (norm {patches} patches, GELU {tokens} merged tokens)": patches
        * dims.hidden
        * 4
        + tokens * dims.merged_width * dt.lin_out,
    }


def _tower_saves(
    scn: Scenario, dims: VisionDims, dt: LayerDtypes, patches: int, largest: int
) -> dict[str, int]:
    """The vision blocks' saved tensors under `lora.vision_tower` (checkpointed: inputs + one block)."""
    shape = block_shape(dims, scn.model)
    lora = LoraShape(scn.lora_r, "all-linear", scn.use_dora, 0, 0, 0, shape.linears, ()) if scn.lora else None
    # Attention runs per image (window and full blocks alike): the largest image is its longest sequence.
    per_patch = sum(
        t.bytes for t in layer_split(replace(scn, seq_len=largest, micro_batch_size=1), shape, lora, dt)[0]
    )
    if scn.activation_checkpointing is True:
        inputs = dims.depth * patches * dims.hidden * tower_bytes(scn)
        return {
            f"vision blocks' checkpointed inputs ({dims.depth} x {patches} patches)": inputs,
            f"recomputed vision block ({patches} patches x {per_patch:,} B)": per_patch * patches,
        }
    return {
        f"vision blocks' saved tensors ({dims.depth} x {patches} patches x {per_patch:,} B)": dims.depth
        * per_patch
        * patches
    }


def _cross_attention(scn: Scenario, shape: ModelShape, dt: LayerDtypes, tokens: int) -> dict[str, int]:
    """Llama 3.2 Vision: the projected image states and every cross-attention layer's saved keys and values."""
    from zerofit.catalogue.models import model_config_dict

    layers = len(model_config_dict(scn.model).get("text_config", {}).get("cross_attention_layers") or ())
    if not layers:
        return {}
    half = dt.att
    states = tokens * shape.hidden_size * half
    kv = layers * 2 * tokens * shape.kv_dim * half
    return {
        f"cross-attention states ({tokens} image tokens x {shape.hidden_size})": states,
        f"cross-attention keys/values ({layers} layers x {tokens} image tokens)": kv,
    }


def vision_terms(scn: Scenario) -> VisionTerms:
    """What the planned micro-batch's images add (nothing for a language model)."""
    dims = vision_dims(scn.model)
    if dims is None or scn.images is None or not scn.image_tokens:
        return VisionTerms()
    dt = layer_dtypes(scn, compute_profile(scn))
    shape = model_shape(scn.model)
    tokens = scn.image_tokens
    patches = tokens * dims.patches_per_token
    largest = scn.images.largest_image * dims.patches_per_token
    held = {f"pixel values (fp32, {patches} patches x {dims.patch_width})": 4 * patches * dims.patch_width}
    trains = not scn.lora or scn.lora_vision_tower  # full fine-tuning, or LoRA on the tower
    frozen_grad = (
        _frozen_with_grad(scn, dims, dt, patches, tokens) if scn.checkpointed(shape.num_layers) else {}
    )
    if trains:
        held.update(_tower_saves(scn, dims, dt, patches, largest))
    elif scn.lora_projector != "full":
        held.update(frozen_grad)
    else:  # the projector trains: its saves below, the frozen blocks' inputs here
        held.update(dict(list(frozen_grad.items())[:1]))
    if trains or scn.lora_projector == "full":
        saves = tokens * dims.merged_width * (4 + 3 * dt.lin_out)
        held[f"projector saved inputs ({tokens} merged tokens x {dims.merged_width})"] = saves
    held.update(_cross_attention(scn, shape, dt, tokens))
    # The frozen tower's moment: one block's working set over every patch, and the features it returns.
    working = patches * (dims.hidden * (4 + 5 * dt.lin_out) + 3 * dims.intermediate * dt.lin_out)
    features = tokens * shape.hidden_size * dt.lin_out
    return VisionTerms(held=held, tower_forward=working + features, patches=patches)


def vision_notes(scn: Scenario) -> list[str]:
    """What the estimate counts for a vision-language model's tower and images (none for a language model)."""
    shape = model_shape(scn.model)
    if not shape.is_vision or scn.images is None:
        return []
    if not scn.lora:
        how = "trained in full"
    else:
        tower = "LoRA on its linears" if scn.lora_vision_tower else "frozen"
        how = f"tower {tower}, projector {scn.lora_projector}"
    kbit = (
        ", in fp32 after k-bit preparation (quantization.fp32_residual)"
        if scn.quantization != "none" and scn.fp32_residual
        else ""
    )
    return [
        f"vision tower ({shape.vision_params:,} params) and projector ({shape.projector_params:,}): {how}; "
        f"never quantized{kbit}; counted in the weights above",
        f"image tokens: {scn.image_tokens} in the planned micro-batch of {scn.rows} rows, largest image "
        f"{scn.images.largest_image} tokens; {scn.images.source}",
    ]
