"""The built-in tiny Llama: a normal HF folder, loaded through from_pretrained, seeded, and race-safe to build."""

from __future__ import annotations

import multiprocessing
import shutil
import string
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from zerofit.catalogue.models import TINY_LLAMA_CONFIG
from zerofit.models import tiny as tiny_llama
from zerofit.models.tiny import ensure_tiny_llama, tiny_llama_path


@pytest.fixture(scope="module")
def folder() -> Path:
    return ensure_tiny_llama(0)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_folder_loads_through_from_pretrained(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert getattr(model.config, key) == TINY_LLAMA_CONFIG[key]
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) <= TINY_LLAMA_CONFIG["vocab_size"]


def test_tokenizer_round_trips_ascii_without_adding_specials(folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = "reverse: Hello, World!\n  add: 12+7 = 19\t~{}[]|\\\"'`" + string.ascii_letters + string.digits
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, nothing added
    assert not {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id} & set(ids)
    assert tok.decode(ids) == text
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]


def test_same_seed_same_weights_other_seed_differs(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    again, other = ensure_tiny_llama(0), ensure_tiny_llama(1)
    # A one-time build says so in one line, with where it goes (a newcomer otherwise sees a silent pause).
    notes = [line for line in capsys.readouterr().out.splitlines() if "once into" in line]
    assert notes == [
        f"zerofit: building tiny-llama once into {p} (the built-in model; later runs reuse it)"
        for p in (again, other)
    ]
    assert again != folder and again.parent == tmp_path
    a, b, c = _weights(folder), _weights(again), _weights(other)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"]
    )


def test_second_call_reuses_the_folder(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("rebuilt an existing folder")

    monkeypatch.setattr(tiny_llama, "_build_into", fail)
    assert ensure_tiny_llama(0) == folder


def test_waiting_for_the_lock_then_reusing_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the build lock and finishes the folder: we wait, then reuse it unbuilt."""
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    target = tiny_llama_path(3)
    built_by_us: list[Path] = []
    real_build = tiny_llama._build_into
    monkeypatch.setattr(tiny_llama, "_build_into", lambda folder, seed: built_by_us.append(folder))
    result: list[Path] = []
    with tiny_llama._build_lock(target):  # the "other process" (flock: a separate open file conflicts)
        waiter = threading.Thread(target=lambda: result.append(ensure_tiny_llama(3)))
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive() and not result  # blocked on the lock, not building
        tmp = tmp_path / ".winner"
        tmp.mkdir()
        real_build(tmp, 3)
        tmp.rename(target)
    waiter.join(timeout=60)
    assert result == [target] and not built_by_us
    assert tiny_llama.incomplete_reason(target) is None


def _plant(folder: Path, source: Path, names: tuple[str, ...]) -> None:
    folder.mkdir(parents=True)
    for name in names:
        shutil.copy2(source / name, folder / name)


@pytest.mark.parametrize(
    ("kept", "reason"),
    [
        # What a non-zero rank's `save_pretrained` left in place before the fix: the tokenizer only.
        (("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"), "no config.json"),
        # Every file but no completion marker: a build killed before it finished (or an older zerofit).
        (
            (
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja",
            ),
            f"no {tiny_llama.MARKER}",
        ),
    ],
)
def test_an_incomplete_folder_is_rebuilt_with_a_note(
    folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kept: tuple[str, ...],
    reason: str,
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    target = tiny_llama_path(0)
    _plant(target, folder, kept)
    _plant(tmp_path / f".{target.name}.tmp-killed", folder, kept[:1])  # a build killed mid-way: cleaned up
    assert ensure_tiny_llama(0) == target
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"zerofit: {target} was incomplete ({reason}")
    assert err.rstrip().endswith(": rebuilding it")
    assert tiny_llama.incomplete_reason(target) is None
    a, b = _weights(folder), _weights(target)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same seed, same weights
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, f".{target.name}.lock"])
    ensure_tiny_llama(0)
    assert capsys.readouterr().err == ""  # repaired once, then reused quietly


def test_bytes_are_those_save_pretrained_writes(folder: Path, tmp_path: Path) -> None:
    """The files written directly (not through rank-dependent save_pretrained) keep the weights' bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG))
    model.save_pretrained(tmp_path)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), name


def _build_in_child(cache: str, barrier: Any, out: Any) -> None:
    import os

    os.environ["ZEROFIT_CACHE"] = cache
    barrier.wait()
    out.put(str(ensure_tiny_llama(7)))


def test_two_processes_build_at_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")  # cheap: the children share this process's imports
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    results = {out.get(timeout=5), out.get(timeout=5)}
    target = tmp_path / tiny_llama_path(7).name  # the children set ZEROFIT_CACHE to tmp_path
    assert results == {str(target)}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, f".{target.name}.lock"])
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(target).config.vocab_size == TINY_LLAMA_CONFIG["vocab_size"]
