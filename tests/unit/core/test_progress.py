"""The one progress helper of every long phase (`zerofit.core.progress`): what a line says, that a short phase
prints nothing, that a long one prints a line each interval of quiet on stdout (never one per update) and a
closing line, that a phase inside another is what the outer one shows, and that the GGUF reader's tqdm bar
becomes counts of that progress."""

from __future__ import annotations

import re
import time

import pytest

from zerofit.core import messages, progress
from zerofit.core.progress import EVERY_S_ENV, Progress


def test_a_line_says_the_phase_its_part_its_count_the_time_and_what_is_left() -> None:
    state = Progress("scoring 36 held-out prompts", 72, "replies")
    state.started -= 40
    state.update(32, status="the trained adapter")
    assert re.fullmatch(
        r"zerofit: scoring 36 held-out prompts \(the trained adapter\): 32/72 replies, 4\d s, eta 5\d s",
        state.line(),
    ), state.line()
    data = Progress("tokenizing data/x.jsonl (JSONL file)", 40 << 20, "B")
    data.update(10 << 20)
    assert data.line().startswith("zerofit: tokenizing data/x.jsonl (JSONL file): 10.0/40.0 MiB, ")
    assert re.fullmatch(
        r"zerofit: converting smollm2-135m-instruct: \d+ s",
        Progress("converting smollm2-135m-instruct").line(),
    )


def test_the_timer_waits_for_an_interval_of_quiet() -> None:
    """The timer's rule (`_due`): a line when the process printed nothing for the interval, else it sleeps
    until the interval would be up (its own lines, `say`, count as printing)."""
    assert progress._due(quiet=10.0, interval=10.0) == (True, 10.0)
    assert progress._due(quiet=3.0, interval=10.0) == (False, 7.0)
    assert progress._due(quiet=9.99, interval=10.0)[0]  # a timer that wakes a hair early is on time


def test_a_short_phase_prints_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EVERY_S_ENV, "3600")
    with progress.progress("scoring", 3, "replies") as state:
        state.advance(3)
    assert capsys.readouterr() == ("", "")


def test_a_long_phase_reports_every_interval_on_stdout_never_per_update(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 updates over about a second with a 0.2 s interval: a few lines, each the whole state, then the
    closing line; none on stderr, and never more than one per interval of quiet."""
    monkeypatch.setenv(EVERY_S_ENV, "0.2")
    started = time.monotonic()
    with progress.progress("sampling", 2000, "tokens") as state:
        for token in range(2000):
            state.update(token + 1)
            time.sleep(0.0005)
        time.sleep(0.3)  # at least one interval after the last update
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == "" and lines[-1].startswith("zerofit: sampling: done in ")
    ticks = lines[:-1]
    assert ticks and all(
        re.match(r"zerofit: sampling: [\d,]+/2,000 tokens, \d+ s", line) for line in ticks
    ), ticks
    assert len(ticks) <= elapsed / (0.2 - progress._SLACK_S) + 1


def test_a_phase_inside_another_is_what_the_outer_timer_shows(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EVERY_S_ENV, "0.1")
    outer = progress.progress("building smollm2-135m-instruct")
    with outer, progress.progress("converting smollm2-135m-instruct", 272, "tensors") as inner:
        inner.update(100)
        time.sleep(0.5)
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith("zerofit: converting smollm2-135m-instruct: 100/272 tensors") for line in lines
    )
    assert lines[-2].startswith("zerofit: converting smollm2-135m-instruct: done in ")
    assert lines[-1].startswith("zerofit: building smollm2-135m-instruct: done in ")
    assert not progress._reporting


def test_a_disabled_phase_takes_updates_and_prints_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EVERY_S_ENV, "0.05")
    with progress.progress("reference log-probs", 4, "forwards", enabled=False) as state:
        state.update(2)
        time.sleep(0.2)
    assert state.done == 2 and capsys.readouterr() == ("", "")


def test_say_writes_its_line_whole_and_counts_as_printing(capsys: pytest.CaptureFixture[str]) -> None:
    messages.say("hello")
    assert capsys.readouterr().out == "hello\n" and messages.quiet_for() < 5


def test_the_gguf_readers_bar_becomes_counts_of_the_progress() -> None:
    """transformers' GGUF reader draws a tqdm bar with carriage returns (one endless line in a log): inside
    `gguf_name_maps_once` its loop counts into the conversion's progress instead, and the bar is put back."""
    from transformers import modeling_gguf_pytorch_utils as reader

    from zerofit.models.pretrained import gguf_name_maps_once

    shipped = reader.tqdm
    state = Progress("converting", unit="tensors")
    with gguf_name_maps_once(state):
        assert list(
            reader.tqdm(["a", "b", "c"], desc="Converting and de-quantizing GGUF tensors...")
        ) == list("abc")
    assert (state.done, state.total) == (3, 3) and reader.tqdm is shipped
