"""Write the bundled tiny image datasets: data/demo-vlm/ with data/demo-vlm.jsonl, and data/demo-vlm-colours/
with data/demo-vlm-colours.jsonl and its held-out probes data/demo-vlm-colours-heldout.jsonl.

demo-vlm: solid-colour images of different sizes (so each becomes a different number of image tokens) with a
question about their colour, and some text-only rows: ragged image + text data for `configs/demo-vlm.yaml` and
the tests.

demo-vlm-colours: the vision demo's task (`configs/demo-vlm-colours.yaml`), one only the image decides: shades
of four colours (HLS: each colour's hue at 6 lightnesses and 2 saturations), the question always the same and
the answer the colour's name alone. Two lightnesses of each colour (one inside the trained range, one beyond it) are
held out: the demo's scorer (`python -m zerofit.demo.score RUN --images ...`) asks about those shades,
which training never saw.

Each PNG is a few hundred bytes. Run from the repository root: `python data/build_demo_vlm.py`.
"""

from __future__ import annotations

import colorsys
import json
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).parent
# (file, colour name, RGB, width x height): widths and heights differ so the image tokens per image differ.
IMAGES = [
    ("red.png", "red", (220, 30, 30), (56, 56)),
    ("green.png", "green", (30, 200, 60), (112, 84)),
    ("blue.png", "blue", (30, 60, 220), (84, 112)),
    ("yellow.png", "yellow", (230, 220, 40), (140, 70)),
    ("black.png", "black", (10, 10, 10), (64, 96)),
    ("white.png", "white", (250, 250, 250), (100, 100)),
]
# The colour demo: hue (HLS) per colour name, the shades of each, and the lightnesses held out.
HUES = {"red": 0.0, "yellow": 1 / 6, "green": 1 / 3, "blue": 2 / 3}
LIGHTNESS = (0.30, 0.38, 0.46, 0.54, 0.62, 0.70)
SATURATION = (0.6, 0.9)
HELD_OUT = (0.46, 0.70)
SHADE_SIZE = (56, 56)  # 4 image tokens of tiny-qwen2-vl
QUESTION = "What colour is this image?"
TEXT_ONLY = [
    ("What colour is the sky on a clear day?", "blue"),
    ("What colour is fresh grass?", "green"),
    ("What colour is snow?", "white"),
    ("What colour is a ripe tomato?", "red"),
]


def write_image(path: Path, rgb: tuple[int, int, int], size: tuple[int, int]) -> None:
    """A solid image with a one-pixel grey border (so the vision tower sees an edge)."""
    image = Image.new("RGB", size, rgb)
    ImageDraw.Draw(image).rectangle([0, 0, size[0] - 1, size[1] - 1], outline=(128, 128, 128))
    image.save(path, optimize=True)


def records() -> list[dict]:
    """OpenAI-style rows with image parts, ShareGPT rows with `<image>` markers, and text-only rows."""
    rows = []
    for i, (name, colour, _, _) in enumerate(IMAGES):
        image = f"demo-vlm/{name}"
        if i % 2 == 0:
            user = [{"type": "image", "image": image}, {"type": "text", "text": "What colour is this image?"}]
            rows.append({"messages": [{"role": "user", "content": user},
                                      {"role": "assistant", "content": f"It is {colour}."}]})  # fmt: skip
        else:
            rows.append({"conversations": [{"from": "human", "value": "<image>Name the colour."},
                                           {"from": "gpt", "value": f"It is {colour}."}],
                         "images": [image]})  # fmt: skip
    for question, answer in TEXT_ONLY:
        rows.append({"messages": [{"role": "user", "content": question},
                                  {"role": "assistant", "content": f"It is {answer}."}]})  # fmt: skip
    return rows


def shades() -> list[tuple[str, str, tuple[int, int, int], bool]]:
    """(file, colour name, RGB, held out) of every shade of the colour demo."""
    out = []
    for colour, hue in HUES.items():
        for light in LIGHTNESS:
            for sat in SATURATION:
                rgb = tuple(round(255 * c) for c in colorsys.hls_to_rgb(hue, light, sat))
                name = f"{colour}-l{round(100 * light)}-s{round(100 * sat)}.png"
                out.append((name, colour, rgb, light in HELD_OUT))
    return out


def write_colours() -> None:
    """The colour demo's images, training conversations and held-out probes."""
    folder = HERE / "demo-vlm-colours"
    folder.mkdir(exist_ok=True)
    train, probes = [], []
    for name, colour, rgb, held in shades():
        write_image(folder / name, rgb, SHADE_SIZE)
        image = f"demo-vlm-colours/{name}"
        if held:
            probes.append({"image": image, "prompt": QUESTION, "answer": colour})
            continue
        user = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
        train.append({"messages": [{"role": "user", "content": user},
                                   {"role": "assistant", "content": colour}]})  # fmt: skip
    (HERE / "demo-vlm-colours.jsonl").write_text("".join(json.dumps(row) + "\n" for row in train))
    (HERE / "demo-vlm-colours-heldout.jsonl").write_text("".join(json.dumps(row) + "\n" for row in probes))


def main() -> None:
    folder = HERE / "demo-vlm"
    folder.mkdir(exist_ok=True)
    for name, _, rgb, size in IMAGES:
        write_image(folder / name, rgb, size)
    lines = "".join(json.dumps(row) + "\n" for row in records())
    (HERE / "demo-vlm.jsonl").write_text(lines)
    write_colours()


if __name__ == "__main__":
    main()
