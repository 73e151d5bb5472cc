"""An image above the model's pixel bound is refused from its header, before it is decoded: a
13000 x 13000 PNG of one colour is 20 KB on disk and took 2.2 GiB to decode (measured on the old code, the
same script as `test_the_refusal_decodes_nothing`); the bound follows from the processor's own size
(`zerofit.models.vision_pixels`), `data.max_image_pixels` moves it, and `zerofit generate --image` checks it too."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from config_helpers import config
from zerofit.core.errors import ConfigError, DataError
from zerofit.data.vision import load_vision_examples
from zerofit.models.build import load_tokenizer
from zerofit.models.tiny_vision import ensure_tiny_vlm
from zerofit.models.vision import load_vision_processor
from zerofit.models.vision_pixels import FLOOR, MARGIN, pixel_bound, processor_largest_pixels
from zerofit.objectives.sft import SFT
from zerofit.recipe.vision_settings import vision_processor_for

BASE = {"model": {"name_or_path": "tiny-qwen2-vl"}, "distributed": {"strategy": "single"}}
HUGE = 13000  # pixels a side: 169 M pixels, under Pillow's own refusal (179 M), which only warns


def write_palette_png(path: Path, width: int, height: int) -> None:
    """A valid one-colour PNG of `width` x `height` (1-bit palette: a few KB on disk whatever its size),
    written without ever holding its pixels."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then every pixel palette entry 0
    packer = zlib.compressobj(9)
    pixels = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 3, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"PLTE", bytes((30, 200, 60)))
        + chunk(b"IDAT", pixels)
        + chunk(b"IEND", b"")
    )


def _data(folder: Path, side: int) -> Path:
    """A one-record data file in `folder` whose image is a `side` x `side` green PNG."""
    write_palette_png(folder / "big.png", side, side)
    user = [{"type": "image", "image": "big.png"}, {"type": "text", "text": "What colour is this image?"}]
    row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "green"}]}
    path = folder / "data.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize(
    ("name", "largest"),
    [
        ("tiny-qwen2-vl", 112 * 112),  # its max_pixels
        ("tiny-smolvlm", 112 * 112),  # its longest edge, squared
        ("tiny-llava", 28 * 28),  # its crop size
        ("tiny-gemma3-vl", 56 * 56),  # its fixed size
        ("tiny-mllama", 2 * 28 * 28),  # its tile size x its most tiles
    ],
)
def test_the_bound_follows_from_each_familys_processor(name: str, largest: int) -> None:
    cfg = config({**BASE, "model": {"name_or_path": name}})
    tokens = None if name == "tiny-mllama" else 4  # data.max_image_tokens (refused for Mllama)
    processor = load_vision_processor(str(ensure_tiny_vlm(name)), load_tokenizer(cfg))
    assert processor_largest_pixels(processor.image_processor, processor.family.kind) == largest
    # The bound is the processor's own size, not the one data.max_image_tokens lowers.
    lowered = load_vision_processor(str(ensure_tiny_vlm(name)), load_tokenizer(cfg), tokens)
    assert lowered.pixel_bound == processor.pixel_bound
    assert processor.pixel_bound.pixels == max(MARGIN * largest, FLOOR) == FLOOR  # tiny: the floor


def test_a_real_sized_processor_gets_its_margin() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    qwen = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)  # Qwen2-VL's preprocessor_config
    assert pixel_bound(qwen, "grid", None).pixels == 4 * 12845056
    smol = SmolVLMImageProcessorPil(size={"longest_edge": 2048})  # SmolVLM-256M's
    assert pixel_bound(smol, "tiles", None).pixels == 4 * 2048 * 2048
    assert pixel_bound(smol, "tiles", 1000).pixels == 1000


def test_a_huge_image_is_refused_from_its_header_in_one_paragraph(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zerofit.cli import main as cli

    path = _data(tmp_path, HUGE)
    assert (tmp_path / "big.png").stat().st_size < 64 * 1024
    cfg = config(BASE, data={"path": str(path)})
    processor = vision_processor_for(cfg, load_tokenizer(cfg), SFT)
    with pytest.raises(DataError) as caught:
        load_vision_examples(path, processor, 128)
    text = str(caught.value)
    assert "\n" not in text and f"{path}:1" in text and "big.png" in text
    assert "13000 x 13000 = 169,000,000 pixels" in text and "data.max_image_pixels=169000000" in text
    model = str(ensure_tiny_vlm("tiny-qwen2-vl"))
    image = str(tmp_path / "big.png")
    assert cli(["generate", model, "--image", image, "--prompt", "Colour?"]) == 2
    err = capsys.readouterr().err
    assert "13000 x 13000" in err and "big.png" in err and "Traceback" not in err


def test_the_refusal_decodes_nothing(tmp_path: Path) -> None:
    """The peak memory of a process that loads the data rises by less than the image's 1-byte-a-pixel
    decode alone (169 MB; the old code rose 2.2 GiB on this script)."""
    path = _data(tmp_path, HUGE)
    script = f"""
import resource, sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from config_helpers import config
from zerofit.data.vision import load_vision_examples
from zerofit.models.build import load_tokenizer
from zerofit.objectives.sft import SFT
from zerofit.recipe.vision_settings import vision_processor_for
cfg = config({BASE!r}, data={{"path": {str(path)!r}}})
processor = vision_processor_for(cfg, load_tokenizer(cfg), SFT)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_vision_examples({str(path)!r}, processor, 128, cache=False)
except Exception as exc:
    print(type(exc).__name__)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    kind, rise = out.split()
    assert kind == "DataError" and int(rise) < 100 * 2**20


def test_max_image_pixels_raises_the_bound(tmp_path: Path) -> None:
    side = 2100  # 4.41 M pixels: above the tiny model's bound (the 2048 x 2048 floor), cheap to decode
    path = _data(tmp_path, side)
    cfg = config(BASE, data={"path": str(path)})
    with pytest.raises(DataError, match=r"2100 x 2100 = 4,410,000 pixels.*data\.max_image_pixels=4410000"):
        load_vision_examples(path, vision_processor_for(cfg, load_tokenizer(cfg), SFT), 128)
    cfg = config(BASE, data={"path": str(path), "max_image_pixels": side * side})
    data = load_vision_examples(path, vision_processor_for(cfg, load_tokenizer(cfg), SFT), 128)
    assert data.stats.n_examples == 1 and data.examples[0].images["image_grid_thw"].prod() == 64
    lower = config(BASE, data={"path": str(path), "max_image_pixels": side * side - 1})
    with pytest.raises(DataError, match=r"above the bound of 4,409,999 pixels \(data\.max_image_pixels\)"):
        load_vision_examples(path, vision_processor_for(lower, load_tokenizer(lower), SFT), 128)
    with pytest.raises(ConfigError, match=r"data\.max_image_pixels"):
        config(BASE, data={"max_image_pixels": 0})
