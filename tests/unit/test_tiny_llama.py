"""The built-in tiny Llama: a normal HF folder, loaded through from_pretrained, seeded, and race-safe to build."""

from __future__ import annotations

import multiprocessing
import string
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from zerofit import tiny_llama
from zerofit.catalogue import TINY_LLAMA_CONFIG
from zerofit.tiny_llama import ensure_tiny_llama, tiny_llama_path


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
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    again, other = ensure_tiny_llama(0), ensure_tiny_llama(1)
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


def test_losing_the_race_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process finishes first while we build: we return its folder and discard our copy."""
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    real_build = tiny_llama._build_into
    target = tiny_llama_path(3)

    def build_then_lose(folder: Path, seed: int) -> None:
        real_build(folder, seed)
        target.mkdir()
        real_build(target, seed)  # the "other process" renames its complete folder into place first
        (target / "winner").touch()

    monkeypatch.setattr(tiny_llama, "_build_into", build_then_lose)
    assert ensure_tiny_llama(3) == target
    assert (target / "winner").exists()
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # our temporary copy is gone


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
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(target).config.vocab_size == TINY_LLAMA_CONFIG["vocab_size"]
