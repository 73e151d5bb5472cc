"""Vision-language models: which families zerofit trains, their processors, and what LoRA adapts of them.

A vision-language model is a language model fed, at its image placeholders, the features of a vision tower
(a ViT) passed through a projector. zerofit trains LoRA on the language model by default, the vision tower
and the projector frozen; `lora.projector` (frozen / full) and `lora.vision_tower` (LoRA on its linears)
widen that. The data pipeline (`zerofit.data.vision`) uses the model's own image processor (its resizing
limits, its patching) and tokenizer with its chat template; the number of tokens each image becomes is the
family's processor rule (`VisionProcessor.tokens_per_image`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.core.errors import ConfigError
from zerofit.models.mllama import checkpointable_vision_layers, refuse_image_token_limit, run_idle_images
from zerofit.models.vision_pixels import PixelBound, pixel_bound


@dataclass(frozen=True)
class VisionFamily:
    """One family's module layout and image placeholder.

    `text_model_type`: the `model_type` whose LoRA meaning words (`zerofit.models.lora_targets`) name the
    language model's linears; `language_model`, `vision_tower`, `projector`: regular expressions matching
    the start of those parts' module names; `image_token`: the one token the chat template renders per image,
    which the processor's rule expands to the image's tokens.
    """

    model_type: str
    text_model_type: str
    language_model: str
    vision_tower: str
    projector: str
    image_token: str
    # Module names kept out of 4-bit / 8-bit quantization (the vision tower and projector: QLoRA quantizes
    # only the language model, as the QLoRA recipes of the family do); transformers matches a name from its start.
    unquantized: tuple[str, ...] = ("model.visual",)
    # How an image becomes tokens: "grid" (Qwen-VL: a patch grid per image, merged 2 x 2, with per-token
    # types for M-RoPE) or "fixed" (LLaVA: every image resized to the tower's size, one token per patch);
    # "pooled" (Gemma 3: `mm_tokens_per_image` per image, the tower's patches average-pooled), "tiles"
    # (SmolVLM / Idefics3: tiles of the image plus the whole image, each tile's patches pixel-shuffled), or
    # "cross" (Llama 3.2 Vision: one token per image, its tiles read through cross-attention, `models.mllama`).
    kind: str = "grid"
    # The token the chat template renders per image when it is not `image_token` itself (Gemma 3's
    # `<start_of_image>`, which its processor expands to a span holding the image tokens).
    placeholder: str = ""
    # The per-token types input the model takes (1 on image tokens), when it is not Qwen-VL's
    # `mm_token_type_ids`: Gemma 3's `token_type_ids` (its attention is bidirectional within an image).
    token_type_key: str = ""


FAMILIES: dict[str, VisionFamily] = {
    family.model_type: family
    for family in (
        VisionFamily(
            "qwen2_vl", "qwen2", r"model\.language_model", r"model\.visual\.blocks", r"model\.visual\.merger",
            "<|image_pad|>",
        ),
        VisionFamily(
            "qwen2_5_vl", "qwen2", r"model\.language_model", r"model\.visual\.blocks", r"model\.visual\.merger",
            "<|image_pad|>",
        ),
        VisionFamily(
            "llava", "llama", r"model\.language_model", r"model\.vision_tower", r"model\.multi_modal_projector",
            "<image>", ("model.vision_tower", "model.multi_modal_projector"), "fixed",
        ),
        VisionFamily(
            "mllama", "llama", r"model\.language_model", r"model\.vision_model", r"model\.multi_modal_projector",
            "<|image|>", ("model.vision_model", "model.multi_modal_projector"), "cross",
        ),
        VisionFamily(
            "gemma3", "gemma3_text", r"model\.language_model", r"model\.vision_tower",
            r"model\.multi_modal_projector", "<image_soft_token>",
            ("model.vision_tower", "model.multi_modal_projector"), "pooled", "<start_of_image>", "token_type_ids",
        ),
        VisionFamily(
            "smolvlm", "llama", r"model\.text_model", r"model\.vision_model", r"model\.connector", "<image>",
            ("model.vision_model", "model.connector"), "tiles",
        ),
    )
}  # fmt: skip


def vision_family(model_config: dict[str, Any]) -> VisionFamily | None:
    """The vision-language family of a config.json dict, None for a language-only model."""
    return FAMILIES.get(str(model_config.get("model_type") or ""))


def is_vision_config(model_config: dict[str, Any]) -> bool:
    """Whether a config.json dict describes a vision-language model (it has a vision tower config)."""
    return "vision_config" in model_config


def folder_config(path: str) -> dict[str, Any]:
    """config.json of the model folder `path` ({} when it is not a local folder)."""
    import json

    local = Path(path) / "config.json"
    return json.loads(local.read_text()) if local.is_file() else {}


def require_family(model_config: dict[str, Any], name: str) -> VisionFamily:
    """The model's vision family; ConfigError naming the families zerofit trains otherwise."""
    family = vision_family(model_config)
    if family is None:
        raise ConfigError(
            [
                f"model.name_or_path = {name!r} is a vision-language model of type "
                f"{model_config.get('model_type')!r}, which zerofit does not train yet; the vision families it "
                f"trains: {', '.join(FAMILIES)} (e.g. the built-in tiny-qwen2-vl)"
            ]
        )
    return family


@dataclass
class VisionProcessor:
    """The model's image processor and tokenizer (with its chat template), and its family's image rule."""

    tokenizer: Any
    image_processor: Any
    family: VisionFamily
    model_config: dict[str, Any]
    # The most pixels one image may have: larger ones are refused from their header, before decoding
    # (`data.max_image_pixels`, else from the processor's own size: `zerofit.models.vision_pixels`).
    pixel_bound: PixelBound

    @property
    def token_types(self) -> bool:
        """Whether the model takes per-token types (Qwen-VL's `mm_token_type_ids`: 1 on image tokens)."""
        return self.token_type_key is not None

    @property
    def token_type_key(self) -> str | None:
        """The name of the model's per-token types input (1 on image tokens), None when it takes none."""
        return self.family.token_type_key or ("mm_token_type_ids" if self.family.kind == "grid" else None)

    @property
    def placeholder_id(self) -> int:
        """The id of the token the chat template renders once per image (which the processor expands)."""
        return int(self.tokenizer.convert_tokens_to_ids(self.family.placeholder or self.family.image_token))

    @property
    def image_token_id(self) -> int:
        """The id of the placeholder the chat template renders once per image."""
        return int(self.tokenizer.convert_tokens_to_ids(self.family.image_token))

    def preprocess(self, images: list[Any]) -> dict[str, Any]:
        """The image processor's outputs for `images` (pixel values, Qwen's patch grid per image; SmolVLM's
        tiles of all the images as one sample, with each image's `rows` and `cols` of tiles; Mllama's tiles of
        one conversation's images, with their aspect-ratio ids and masks)."""
        if self.family.kind == "tiles":
            return dict(self.image_processor(images=images, return_tensors="pt", return_row_col_info=True))
        if self.family.kind == "cross":  # Mllama's processor takes a list of images per conversation
            out = dict(self.image_processor(images=[images], return_tensors="pt"))
            out.pop("num_tiles", None)  # the aspect-ratio mask holds it; not a model input
            return out
        return dict(self.image_processor(images=images, return_tensors="pt"))

    def tokens_per_image(self, pixels: dict[str, torch.Tensor]) -> list[int]:
        """How many tokens each image becomes, by the family's processor rule: Qwen2-VL's patch grid
        (t x h x w) over the merged patches; LLaVA's patches of the resized image (its CLS token dropped
        under `vision_feature_select_strategy: default`); Mllama's one `<|image|>` token (its tiles reach the
        text through cross-attention, so the sequence does not grow with the image)."""
        if self.family.kind == "cross":
            return [1] * int(pixels["pixel_values"].shape[1])
        if self.family.kind == "grid":
            merge = int(self.image_processor.merge_size)
            return [int(n) for n in pixels["image_grid_thw"].prod(dim=-1) // merge**2]
        if self.family.kind in ("pooled", "tiles"):
            return [self._tiles(i, pixels) * self.tokens_per_tile for i in range(len(self._layout(pixels)))]
        values = pixels["pixel_values"]
        patch = int(self.model_config["vision_config"]["patch_size"])
        cls = 0 if self.model_config.get("vision_feature_select_strategy", "default") == "default" else 1
        per_image = (values.shape[-2] // patch) * (values.shape[-1] // patch) + cls
        return [per_image] * int(values.shape[0])

    @property
    def tokens_per_tile(self) -> int:
        """Gemma 3: `mm_tokens_per_image`; SmolVLM: a tile's patches over the pixel shuffle's scale squared
        (its processor's `image_seq_len`)."""
        if self.family.kind == "pooled":
            return int(self.model_config["mm_tokens_per_image"])
        vision = self.model_config["vision_config"]
        patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
        return patches // int(self.model_config.get("scale_factor", 2)) ** 2

    def stored_image_tokens(self, pixels: dict[str, torch.Tensor]) -> int:
        """How many image tokens an example's model inputs (as training keeps them: `data.vision.IMAGE_INPUTS`)
        account for: SmolVLM's tiles x tokens per tile (its rows and cols of tiles are not model inputs);
        else the sum of `tokens_per_image`. The tokenization cache checks an entry's ids against it."""
        if self.family.kind == "tiles":
            return int(pixels["pixel_values"].shape[1]) * self.tokens_per_tile
        return sum(self.tokens_per_image(pixels))

    def _layout(self, pixels: dict[str, Any]) -> list[tuple[int, int]]:
        """(rows, cols) of tiles per image (SmolVLM; (0, 0) for an unsplit image and for Gemma 3)."""
        if self.family.kind != "tiles":
            return [(0, 0)] * int(pixels["pixel_values"].shape[0])
        rows = [r for sample in pixels["rows"] for r in sample]
        cols = [c for sample in pixels["cols"] for c in sample]
        return list(zip(rows, cols, strict=True))

    def _tiles(self, index: int, pixels: dict[str, Any]) -> int:
        """How many tiles image `index` becomes: its split's rows x cols, plus the whole image as one."""
        rows, cols = self._layout(pixels)[index]
        return rows * cols + 1

    def image_spans(self, pixels: dict[str, Any]) -> list[list[int]]:
        """The token ids each image's placeholder becomes, as the family's processor writes it: Qwen-VL's and
        LLaVA's image token repeated; Gemma 3's `full_image_sequence`; SmolVLM's tiles
        (`get_image_prompt_string`: a `<row_i_col_j>` per tile, `<global-img>` for the whole image, each
        tile's image tokens between `<fake_token_around_image>`s)."""
        counts = self.tokens_per_image(pixels)
        token = self.family.image_token
        if self.family.kind == "pooled":
            texts = [f"\n\n{self.family.placeholder}{token * n}<end_of_image>\n\n" for n in counts]
        elif self.family.kind == "tiles":
            from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

            per_tile = self.tokens_per_tile
            texts = [
                get_image_prompt_string(
                    rows, cols, per_tile, "<fake_token_around_image>", token, "<global-img>"
                )
                for rows, cols in self._layout(pixels)
            ]
        else:
            return [[self.image_token_id] * n for n in counts]
        return [list(self.tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def limit_image_tokens(image_processor: Any, max_image_tokens: int | None, name: str) -> None:
    """`data.max_image_tokens`: lower the image processor's largest image (pixels) to that many tokens; an
    image is resized (aspect kept) to fit, as the processor's own `max_pixels` does."""
    if max_image_tokens is None or not hasattr(image_processor, "merge_size"):
        return  # a fixed-size family (LLaVA) has no per-image limit to lower
    unit = (int(image_processor.patch_size) * int(image_processor.merge_size)) ** 2
    least = int(image_processor.size["shortest_edge"])
    if max_image_tokens * unit < least:
        raise ConfigError(
            [
                f"data.max_image_tokens = {max_image_tokens}: the image processor of {name} makes every image at "
                f"least {least} pixels, {least // unit} tokens of {unit} pixels each; set "
                f"data.max_image_tokens={least // unit} or more"
            ]
        )
    image_processor.size = {"shortest_edge": least, "longest_edge": max_image_tokens * unit}


def limit_tiled_image_tokens(processor: VisionProcessor, max_image_tokens: int | None, name: str) -> None:
    """`data.max_image_tokens` for a family whose images become whole tiles of tokens (Gemma 3: one tile per
    image, `mm_tokens_per_image`; SmolVLM: a split into up to k x k tiles plus the whole image): SmolVLM's
    largest image lowered to the most tiles a side that fit (k x tile pixels); a limit under one tile is
    refused (no image can become fewer tokens)."""
    if max_image_tokens is None or processor.family.kind not in ("pooled", "tiles"):
        return
    per_tile = processor.tokens_per_tile
    if max_image_tokens < per_tile:
        raise ConfigError(
            [
                f"data.max_image_tokens = {max_image_tokens}: every image of {name} becomes at least {per_tile} "
                f"tokens (the {processor.family.model_type} processor's tokens per image tile); set "
                f"data.max_image_tokens={per_tile} or more"
            ]
        )
    if processor.family.kind == "tiles":
        image_processor = processor.image_processor
        tile = int(image_processor.max_image_size["longest_edge"])
        side = 1  # k = 1: the image shrunk to one tile, not split
        while ((side + 1) ** 2 + 1) * per_tile <= max_image_tokens:
            side += 1
        longest = min(int(image_processor.size["longest_edge"]), side * tile)
        image_processor.size = {"longest_edge": longest}


def load_vision_processor(
    path: str, tokenizer: Any, max_image_tokens: int | None = None, max_image_pixels: int | None = None
) -> VisionProcessor:
    """The processor of the vision-language model at `path`: its image processor (PIL backend: no
    torchvision needed) with `tokenizer`, limited to `max_image_tokens` per image (`data.max_image_tokens`);
    images above `max_image_pixels` (`data.max_image_pixels`, else the bound its own size gives) refused."""
    import transformers

    config = folder_config(path)
    family = require_family(config, path)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the note that torchvision is absent: nothing to act on
    try:
        image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    finally:
        transformers.logging.set_verbosity(verbosity)
    if getattr(image_processor, "do_pan_and_scan", False):  # its crops' tokens are not in the family's rule
        raise ConfigError(
            [
                f"model.name_or_path = {path!r}: its image processor has do_pan_and_scan on (Gemma 3's extra crops "
                'of each image), which zerofit does not train yet; set "do_pan_and_scan": false in its '
                "preprocessor_config.json"
            ]
        )
    bound = pixel_bound(image_processor, family.kind, max_image_pixels)  # before max_image_tokens lowers it
    limit_image_tokens(image_processor, max_image_tokens, path)
    if family.kind == "cross":  # Mllama: a fixed number of tiles per image, nothing to lower
        refuse_image_token_limit(max_image_tokens, config["vision_config"], path)
    processor = VisionProcessor(tokenizer, image_processor, family, config, bound)
    limit_tiled_image_tokens(processor, max_image_tokens, path)
    return processor


def lora_target_regex(
    family: VisionFamily, names: tuple[str, ...], vision_names: tuple[str, ...] = ()
) -> str:
    """peft's target_modules as one regular expression (peft full-matches it against each module name): the
    language model's `names`, and with `vision_names` the vision tower's too; the projector never (it is
    trained in full or frozen)."""
    parts = [rf"{family.language_model}\..*\.({'|'.join(map(re.escape, names))})"]
    if vision_names:
        parts.append(rf"{family.vision_tower}\..*\.({'|'.join(map(re.escape, vision_names))})")
    return "|".join(f"(?:{p})" for p in parts)


def vision_linear_names(model: torch.nn.Module, family: VisionFamily) -> tuple[str, ...]:
    """The last name part of every linear layer of the vision tower (`lora.vision_tower`)."""
    tower = re.compile(rf"(?:.*\.)?{family.vision_tower}\.")
    found = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and tower.match(name)
    }
    return tuple(sorted(found))


def vision_lora_targets(
    model: torch.nn.Module, spec: Any, projector: str, vision_tower: bool
) -> Any:  # -> zerofit.models.lora_targets.LoraTargets
    """What LoRA adapts of a vision-language model: `lora.target_modules` mapped by the language model's
    family, as one expression limited to the language model (the vision tower's linears too with
    `lora.vision_tower`); the projector trained in full with `lora.projector = full`, else frozen."""
    from zerofit.models.lora_targets import LoraTargets, resolve_lora_targets, vision_lora_summary

    family = require_family(model.config.to_dict(), str(getattr(model, "name_or_path", "")))
    text = resolve_lora_targets({"model_type": family.text_model_type}, spec.target_modules)
    names = (text.target_modules,) if isinstance(text.target_modules, str) else text.target_modules
    vision = vision_linear_names(model, family) if vision_tower else ()
    regex = lora_target_regex(family, tuple(n.rsplit(".", 1)[-1] for n in names), vision)
    saved = (family.projector.replace("\\", ""),) if projector == "full" else ()
    summary = vision_lora_summary(text, bool(vision), bool(saved))
    return LoraTargets(regex, (), saved, family.model_type, summary)


def apply_vision_lora(
    model: torch.nn.Module, spec: Any, projector: str, vision_tower: bool, seed: int | None
) -> tuple[torch.nn.Module, str]:
    """peft adapters on a vision-language model (`vision_lora_targets`), seeded as `apply_lora`; returns the
    adapted model and what was adapted, in words."""
    from zerofit.models.lora import adapted_counts, peft_lora_config, peft_without_bitsandbytes

    targets = vision_lora_targets(model, spec, projector, vision_tower)
    with torch.random.fork_rng(devices=[]), peft_without_bitsandbytes() as peft:
        if seed is not None:
            torch.manual_seed(seed)
        adapted = peft.get_peft_model(model, peft_lora_config(spec, targets))
    return adapted, f"{targets.summary}: {adapted_counts(adapted).describe()}"


def folder_model_class(path: str | Path) -> Any:
    """transformers' Auto class that loads the model at `path` whole: image-text-to-text for a
    vision-language model (vision tower, projector, language model), causal LM otherwise."""
    import transformers

    vision = is_vision_config(folder_config(str(path)))
    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def save_image_processor(model_path: str, folder: Path) -> None:
    """Write the image processor of the vision-language model at `model_path` into export `folder`
    (preprocessor_config.json), so the export loads whole with its processor; nothing for a language model."""
    if not is_vision_config(folder_config(model_path)):
        return
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        transformers.AutoImageProcessor.from_pretrained(model_path).save_pretrained(folder)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _idle_image(inner: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The smallest image the vision tower takes (one merged token of zeros): its pixel rows and grid."""
    cfg = inner.config.vision_config
    if not hasattr(cfg, "spatial_merge_size"):  # a fixed-size tower (LLaVA's CLIP): one zero image
        tower = getattr(inner, "vision_tower", None) or inner.vision_model  # SmolVLM: `vision_model`
        device = next(tower.parameters()).device
        image = torch.zeros(1, int(cfg.num_channels), cfg.image_size, cfg.image_size, device=device)
        # SmolVLM takes (samples, tiles, ...); an all-zero tile is its padding, but one is kept when all are.
        return {"pixel_values": image[None] if hasattr(inner, "connector") else image}
    merge = int(cfg.spatial_merge_size)
    width = int(cfg.in_channels) * int(cfg.temporal_patch_size) * int(cfg.patch_size) ** 2
    device = next(inner.visual.parameters()).device
    grid = torch.tensor([[1, merge, merge]], device=device)
    return {"pixel_values": torch.zeros(merge * merge, width, device=device), "image_grid_thw": grid}


def run_vision_every_step(hf: torch.nn.Module) -> None:
    """Make every forward run the vision tower and projector, a micro-batch without images too (on the
    smallest zero image, its features added times 0.0 to the token embeddings: the output and every gradient
    are unchanged).

    Sharded engines gather a vision block's weights when it runs (FSDP2 per block, ZeRO-3), in forward and,
    once its output needs a gradient, again in backward; a rank whose micro-batch has no image would skip
    those collectives while the others wait in them. The features join where real ones do (the embeddings),
    so backward reaches the tower in the same order on every rank.

    Llama 3.2 Vision (Mllama) instead gets a padding image per row, which the split-exact loss needs too
    (`models.mllama.run_idle_images`), and its vision layers made checkpointable like its decoder layers."""
    family = vision_family(hf.config.to_dict())
    if family is not None and family.kind == "cross":
        run_idle_images(hf)
        checkpointable_vision_layers(hf)
        return
    inner = getattr(hf, "model", None)
    if inner is None or not hasattr(inner, "get_image_features"):
        return
    embeddings = inner.get_input_embeddings()

    def before(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("pixel_values") is None:
            idle = _idle_image(module)
            pooled = module.get_image_features(**idle).pooler_output
            embeddings.__dict__["_zerofit_idle"] = sum(p.sum() for p in pooled)

    def embedded(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        idle = module.__dict__.pop("_zerofit_idle", None)
        return output if idle is None else output + 0.0 * idle.to(output.dtype)

    inner.register_forward_pre_hook(before, with_kwargs=True)
    embeddings.register_forward_hook(embedded)


def is_vision_model(name_or_path: str) -> bool:
    """Whether model `name_or_path` (a catalogued id or a local folder) is a vision-language model."""
    from zerofit.catalogue.models import model_config_dict

    try:
        return is_vision_config(model_config_dict(name_or_path))
    except ConfigError:
        return False


def unquantized_modules(name_or_path: str) -> tuple[str, ...]:
    """The modules `quantization.load_in` leaves in float for model `name_or_path` (a vision-language model's
    vision tower and projector), () for a language model or a config that cannot be read here."""
    from zerofit.catalogue.models import model_config_dict

    try:
        family = vision_family(model_config_dict(name_or_path))
    except ConfigError:
        return ()
    return family.unquantized if family is not None else ()
