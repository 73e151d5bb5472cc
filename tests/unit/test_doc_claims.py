"""Every count and duration the docs state about the bundled demos is what the files hold (a config once
said 76 chats where its file held 67, a guide called a 107-second demo "seconds", two guides still described
`make demo` as the old 300-step tiny-llama run).

Mechanical, not a regex over prose: a table of (document, the phrase as it stands with `{}` where its
figure is, how to compute the true figure from the data files and configs). A phrase reworded out of the
table fails here until the table follows it, so no claim silently drops out of the check. Comment lines
(`# ...`) and line breaks are read as one paragraph, so a phrase may wrap.

Durations follow the `# needs: ~N minutes` convention: a demo's duration is written `~N minutes` or `~N s`
of CPU (user + system time, robust to a machine shared by other work), never a bare "seconds" or "minutes",
and agrees with the one measurement per demo below.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from doc_blocks import GUIDES, README, REPO

DEMO_CONFIG = re.search(r"^DEMO_CONFIG := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)  # type: ignore[union-attr]


def _lines(path: str) -> int:
    """Records of a bundled JSON Lines file."""
    return sum(1 for line in (REPO / path).read_text().splitlines() if line.strip())


def _config(path: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / path).read_text())


def _max_steps(path: str) -> int:
    return int(_config(path)["train"]["max_steps"])


def _user_asks(path: str, word: str) -> int:
    """Chats of a bundled `messages` file whose first user turn contains `word`."""
    rows = [json.loads(line) for line in (REPO / path).read_text().splitlines() if line.strip()]
    return sum(word in next(m["content"] for m in row["messages"] if m["role"] == "user") for row in rows)


def _epoch(path: str) -> tuple[int, int]:
    """(steps, examples) of one epoch of a config with nothing held out: whole global batches of its file
    (the partial window's last examples are dropped)."""
    cfg = _config(path)
    assert cfg["data"].get("eval_split") is None and cfg["data"].get("eval_path") is None
    steps = _lines(cfg["data"]["path"]) // cfg["batch"]["global_batch_size"]
    return steps, steps * cfg["batch"]["global_batch_size"]


def _held_out(path: str) -> int:
    """Records a config's `data.eval_split` holds out of its file (rounded, as `data.holdout` does)."""
    data = _config(path)["data"]
    return round(data["eval_split"] * _lines(data["path"]))


def _shown(score: str) -> tuple[int, int, int]:
    """(base, trained, of) of the README's shown `make demo` report, for `task` or `facts`."""
    label = {"task": "Held-out task", "facts": "Held-out facts"}[score]
    found = re.search(re.escape(label) + r".*: base (\d+)/(\d+) -> trained (\d+)/", README.read_text())
    assert found, "README.md shows the demo's report"
    base, of, trained = (int(n) for n in found.groups())
    return base, trained, of


SMOL = "configs/demo-smollm2.yaml"
SMOL_DATA = "data/demo_smollm2.jsonl"
HELDOUT = "data/demo_smollm2_heldout.jsonl"
FACTS = "data/demo_smollm2_facts.jsonl"
COLOURS, COLOURS_HELDOUT = "data/demo-vlm-colours.jsonl", "data/demo-vlm-colours-heldout.jsonl"
COUNTS: list[tuple[str, str, Callable[[], float]]] = [
    ("README.md", "{} steps of `configs/demo-smollm2.yaml`", lambda: _max_steps(SMOL)),
    ("README.md", "from {} short chats (`data/demo_smollm2.jsonl`)", lambda: _lines(SMOL_DATA)),
    (
        "README.md",
        "the format on {} new questions (`data/demo_smollm2_heldout.jsonl`)",
        lambda: _lines(HELDOUT),
    ),
    ("README.md", "and {} capitals (`data/demo_smollm2_facts.jsonl`)", lambda: _lines(FACTS)),
    ("README.md", "of which the base model knows {} and", lambda: _shown("facts")[0]),
    ("README.md", "one of the {} that fail the format", lambda: _shown("task")[2] - _shown("task")[1]),
    ("README.md", "The facts stay at {} of 16", lambda: _shown("facts")[1]),
    ("README.md", "The facts stay at 13 of {} with", lambda: _lines(FACTS)),
    (SMOL, "from {} short chats (data/demo_smollm2.jsonl;", lambda: _lines(SMOL_DATA)),
    (SMOL, "{} ask for capitals", lambda: _user_asks(SMOL_DATA, "capital")),
    (SMOL, "the format on {} new questions", lambda: _lines(HELDOUT)),
    (SMOL, "and {} capitals the base model knows", lambda: _lines(FACTS)),
    (SMOL, "# {} epochs of 8 steps", lambda: _max_steps(SMOL) / _epoch(SMOL)[0]),
    (SMOL, "epochs of {} steps (64", lambda: _epoch(SMOL)[0]),
    (SMOL, "steps ({} of the 67 chats each)", lambda: _epoch(SMOL)[1]),
    (SMOL, "of the {} chats each)", lambda: _lines(SMOL_DATA)),
    ("configs/demo-chat.yaml", "{} of the 1,000 conversations", lambda: _held_out("configs/demo-chat.yaml")),
    ("configs/demo-chat.yaml", "of the {} conversations", lambda: _lines("data/demo_chat.jsonl")),
    ("configs/demo-tools.yaml", "of the {} conversations", lambda: _lines("data/demo_tools.jsonl")),
    ("configs/demo-tools.yaml", "{} of the 48 conversations", lambda: _held_out("configs/demo-tools.yaml")),
    ("configs/demo-dpo.yaml", "{} held-out pairs", lambda: _held_out("configs/demo-dpo.yaml")),
    ("configs/demo-kto.yaml", "{} held-out examples", lambda: _held_out("configs/demo-kto.yaml")),
    ("configs/demo-grpo.yaml", "holds out {} prompts", lambda: _lines("data/demo_grpo_heldout.jsonl")),
    ("docs/guides/compare.md", "needs: minutes (2 x {} steps)", lambda: _max_steps("configs/demo.yaml")),
    (
        "docs/guides/compare.md",
        "bf16, global 16 = micro 4 x accum 2 x dp 2, {} steps)",
        lambda: _max_steps("configs/demo.yaml"),
    ),
    ("docs/guides/export.md", "`configs/demo.yaml`'s {} steps", lambda: _max_steps("configs/demo.yaml")),
    (
        "docs/guides/data.md",
        "CPU cores ({} steps, 7 evaluations)",
        lambda: _max_steps("configs/demo-chat.yaml"),
    ),
    (
        "docs/guides/data.md",
        "CPU cores ({} steps, 3 evaluations)",
        lambda: _max_steps("configs/demo-tools.yaml"),
    ),
    ("docs/guides/preference.md", "LoRA KTO, {} steps)", lambda: _max_steps("configs/demo-kto.yaml")),
    ("docs/guides/preference.md", "LoRA DPO, {} steps,", lambda: _max_steps("configs/demo-dpo.yaml")),
    ("docs/guides/vision.md", "an image: {} shades of red, yellow,", lambda: _lines(COLOURS)),
    ("docs/guides/vision.md", "about those {} shades, greedily", lambda: _lines(COLOURS_HELDOUT)),
    (
        "docs/guides/vision.md",
        "in full ({} steps, ~26 s",
        lambda: _max_steps("configs/demo-vlm-colours.yaml"),
    ),
]

# CPU time (user + system of the launch and its children) of each demo as its config runs it (one process,
# W&B off), measured with `/usr/bin/time` on this project's 2-core machine (AVX512-BF16) on 2026-12-06,
# while other work loaded it (wall times were 3-5x these): the figure its docs state. Remeasure after a
# change that makes a demo much faster or slower, and update the docs with it.
MEASURED_CPU_S = {
    "demo-dpo": 64.6,
    "demo-kto": 72.8,
    "demo-reward": 79.5,
    "demo-vlm": 22.3,
    "demo-vlm-colours": 26.4,
    "demo-grpo": 256.9,
}
# (document, the phrase with `{}` where the duration stands, the demo it times)
DURATIONS = [
    ("configs/demo-dpo.yaml", "Preference tuning in {} of CPU", "demo-dpo"),
    ("docs/guides/preference.md", "LoRA DPO, 16 steps, {} of CPU", "demo-dpo"),
    ("configs/demo-kto.yaml", "KTO in {} of CPU", "demo-kto"),
    ("docs/guides/preference.md", "needs: {} of CPU (tiny-llama, LoRA KTO", "demo-kto"),
    ("configs/demo-reward.yaml", "A reward model in {} of CPU", "demo-reward"),
    ("docs/guides/preference.md", "score head, LoRA, one process, {} of CPU", "demo-reward"),
    ("configs/demo-vlm.yaml", "configs/demo-vlm.yaml` ({} of CPU)", "demo-vlm"),
    ("configs/demo-vlm-colours.yaml", "configs/demo-vlm-colours.yaml` ({} of CPU)", "demo-vlm-colours"),
    ("docs/guides/vision.md", "in full (80 steps, {} of CPU)", "demo-vlm-colours"),
    ("configs/demo-grpo.yaml", "Online RL in {} of CPU", "demo-grpo"),
]
DURATION = re.compile(r"~(\d+(?:\.\d+)?) (s|minutes?)")


def _paragraph(doc: str) -> str:
    """`doc` as one line: comment markers dropped, every run of whitespace one space."""
    text = (REPO / doc).read_text()
    return " ".join(re.sub(r"^\s*#+ ?", "", line) for line in text.splitlines()).replace("\t", " ")


def _figure(doc: str, phrase: str, pattern: str) -> str:
    """The text standing where `{}` is in `phrase` in `doc` (the phrase must be there, once or more alike)."""
    before, after = (re.escape(part) for part in phrase.split("{}"))
    found = set(re.findall(before + f"({pattern})" + after, re.sub(r"\s+", " ", _paragraph(doc))))
    assert found, f"{doc} no longer says {phrase!r}: reword the table in {Path(__file__).name} with it"
    assert len(found) == 1, f"{doc} says {phrase!r} with different figures: {sorted(found)}"
    return found.pop()


@pytest.mark.parametrize(("doc", "phrase", "truth"), COUNTS, ids=[f"{d}: {p}" for d, p, _ in COUNTS])
def test_a_count_a_doc_states_is_what_the_files_hold(
    doc: str, phrase: str, truth: Callable[[], float]
) -> None:
    stated = float(_figure(doc, phrase, r"[\d,]+(?:\.\d+)?").replace(",", ""))
    assert stated == truth(), f"{doc} says {phrase.format(stated)!r}; the files give {truth()}"


@pytest.mark.parametrize(("doc", "phrase", "demo"), DURATIONS, ids=[f"{d}: {p}" for d, p, _ in DURATIONS])
def test_a_demo_duration_a_doc_states_is_the_measured_one(doc: str, phrase: str, demo: str) -> None:
    stated = _figure(doc, phrase, r"~\d+(?:\.\d+)? (?:s|minutes?)")
    number, unit = DURATION.fullmatch(stated).groups()  # type: ignore[union-attr]
    seconds = float(number) * (1 if unit == "s" else 60)
    measured = MEASURED_CPU_S[demo]
    # "~N minutes" rounds to whole minutes (at least 1); "~N s" to a figure within a quarter.
    if unit == "s":
        assert abs(seconds - measured) <= 0.25 * measured, (doc, stated, measured)
    else:
        assert number == str(max(1, round(measured / 60))), (doc, stated, measured)


def test_no_doc_says_a_demo_takes_seconds_or_minutes_without_a_figure() -> None:
    """The old "in seconds" / "one process, seconds": a duration a reader can check is a figure. Read in the
    demo configs' comments and on the docs' lines that name a demo config."""
    vague = re.compile(r"\b(?:in|process,|\() ?(?:seconds|minutes)\b")
    configs = [f"configs/{p.name}" for p in (REPO / "configs").glob("demo*.yaml")]
    docs = ["README.md", *(f"docs/guides/{p.name}" for p in GUIDES.glob("*.md"))]
    lines = [
        (doc, line)
        for doc in docs
        for line in (REPO / doc).read_text().splitlines()
        if "configs/demo" in line
    ]
    lines += [(doc, _paragraph(doc)) for doc in configs]
    found = [(doc, m.group(0)) for doc, line in lines for m in vague.finditer(line)]
    assert not found, found


def test_what_the_docs_call_make_demo_is_the_makefiles_demo() -> None:
    """A sentence that names `make demo` with a config or a step count names the Makefile's DEMO_CONFIG and
    its steps: no guide still describes the old 300-step tiny-llama demo (configs/demo.yaml) as `make demo`."""
    docs = ["README.md", *(f"docs/guides/{p.name}" for p in GUIDES.glob("*.md"))]
    steps = _max_steps(DEMO_CONFIG)
    wrong = []
    for doc in docs:
        for sentence in re.split(r"(?<=[.!?]) ", re.sub(r"\s+", " ", _paragraph(doc))):
            if "make demo" not in sentence:
                continue
            configs = set(re.findall(r"configs/[\w.-]+\.yaml", sentence)) - {DEMO_CONFIG}
            overridden = {int(n) for n in re.findall(r"max_steps=(\d+)", sentence)}  # DEMO_ARGS=...
            counts = {int(n) for n in re.findall(r"\b(\d+) steps\b", sentence)} - {steps} - overridden
            if configs or counts or "make demo`'s job" in sentence:
                wrong.append((doc, sentence[:200]))
    assert not wrong, wrong
