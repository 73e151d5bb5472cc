"""Write the bundled tiny image dataset: data/demo-vlm/*.png and data/demo-vlm.jsonl.

Solid-colour images of different sizes (so each becomes a different number of image tokens) with a question
about their colour, and some text-only rows: ragged image + text data for `configs/demo-vlm.yaml` and the
tests. Each PNG is a few hundred bytes. Run from the repository root: `python data/build_demo_vlm.py`.
"""

from __future__ import annotations

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


def main() -> None:
    folder = HERE / "demo-vlm"
    folder.mkdir(exist_ok=True)
    for name, _, rgb, size in IMAGES:
        write_image(folder / name, rgb, size)
    lines = "".join(json.dumps(row) + "\n" for row in records())
    (HERE / "demo-vlm.jsonl").write_text(lines)


if __name__ == "__main__":
    main()
