"""`zerofit export --format gguf`, verified by loading the file back with transformers' GGUF reader.

One real run (the demo config: tiny-llama, LoRA on every projection and lm_head, bf16; one process, 4 steps)
is exported to GGUF in f16, bf16 and q8_0 and, as the reference, merged to Hugging Face safetensors in fp32.
Each GGUF must load with `AutoModelForCausalLM` / `AutoTokenizer` `from_pretrained(dir, gguf_file=...)`
and give:

- f16 / bf16: exactly the merged weights rounded to that dtype (names, q/k rotary permutation and all);
- logits within the dtype's tolerance of the merged model's: `TOLERANCE` x the largest |logit|, a few
  rounding steps of each type (f16: 2^-11, bf16: 2^-8 relative; q8_0 stores each block of 32 weights as
  int8 steps of max|w|/127, about 2^-8 of the block's largest weight per weight, summed over a layer's
  inputs: looser);
- the same greedy tokens for a few prompts; the tokenizer's ids (bos added as llama.cpp adds it) and text
  round-trip, the chat template is carried and applies to the same ids.

Also: a checkpoint and the final export of the same step give the same GGUF; qwen2 / qwen3 / mistral
layouts round-trip exactly (random tiny models, f32); an unsupported architecture or a type the gguf package
cannot write is one paragraph; a write that fails leaves no partial .gguf; when llama-cpp-python is installed
(extra gguf-run), llama.cpp itself tokenizes the prompts to the same ids and computes logits within the same
tolerance, with the same greedy token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from config_helpers import DEMO_DATA, train_demo
from zerofit.cli import main as cli
from zerofit.core.errors import ConfigError
from zerofit.export import export_gguf, export_run

STEPS = 4
PROMPTS = ["12 + 7 =", "reverse: abc", "copy: hello world"]
TOLERANCE = {"f16": 4 * 2.0**-11, "bf16": 4 * 2.0**-8, "q8_0": 16 * 2.0**-8}
TORCH_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo config trained for 4 steps on one process (final export adapter/ and checkpoint step-4)."""
    return train_demo(tmp_path_factory.mktemp("gguf"), STEPS)


@pytest.fixture(scope="module")
def merged(run_dir: Path) -> Any:
    """The reference: the run merged to HF safetensors in fp32 (`zerofit export --merge`), loaded back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = export_run(run_dir, run_dir.parent / "merged", merge=True, dtype="fp32").out
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def gguf_dir(run_dir: Path) -> Path:
    """One folder holding the f16, bf16 and q8_0 exports (several types share a folder)."""
    folder = run_dir.parent / "gguf"
    for quant in TOLERANCE:
        export_gguf(run_dir, folder, quant=quant)
    return folder


def _load(folder: Path, name: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _ids(tokenizer: Any, prompt: str) -> torch.Tensor:
    return torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]])


def _greedy(model: Any, ids: torch.Tensor, tokenizer: Any) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("quant", list(TOLERANCE))
def test_gguf_loads_back_with_the_merged_models_logits_and_greedy_tokens(
    merged: Any, gguf_dir: Path, quant: str
) -> None:
    reference, tokenizer = merged
    model, _ = _load(gguf_dir, f"demo-{quant}.gguf")
    worst, scale = 0.0, 0.0
    for prompt in PROMPTS:
        ids = _ids(tokenizer, prompt)
        with torch.no_grad():
            want, got = reference(ids).logits, model(ids).logits
        worst, scale = max(worst, float((got - want).abs().max())), max(scale, float(want.abs().max()))
        assert _greedy(model, ids, tokenizer) == _greedy(reference, ids, tokenizer), (quant, prompt)
    print(f"{quant}: max |logit difference| {worst:.3g} (largest |logit| {scale:.3g})")
    assert worst <= TOLERANCE[quant] * scale, (quant, worst, scale)
    assert worst > 0  # the comparison sees the file's rounding, not the reference again


@pytest.mark.slow
@pytest.mark.parametrize("quant", list(TORCH_DTYPE))
def test_half_precision_gguf_holds_exactly_the_rounded_merged_weights(
    merged: Any, gguf_dir: Path, quant: str
) -> None:
    reference, _ = merged
    model, _ = _load(gguf_dir, f"demo-{quant}.gguf")
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        rounded = tensor.to(TORCH_DTYPE[quant]).float() if tensor.ndim > 1 else tensor  # norms stay f32
        assert torch.equal(got[name], rounded), name


@pytest.mark.slow
def test_the_tokenizer_and_chat_template_round_trip(merged: Any, gguf_dir: Path) -> None:
    _, tokenizer = merged
    _, loaded = _load(gguf_dir, "demo-f16.gguf")
    for text in ["12 + 7 = 19", "reverse: abc\tdef\n", '  spaces  and ~!@#$%^&*()_+{}|:"<>?']:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.encode(text) == [tokenizer.bos_token_id, *ids]  # add_bos_token, as zerofit trains
        assert loaded.decode(ids) == text
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    assert [getattr(loaded, s) for s in specials] == [getattr(tokenizer, s) for s in specials]
    assert loaded.chat_template == tokenizer.chat_template
    chat = [{"role": "user", "content": "2 + 2"}, {"role": "assistant", "content": "4"}]
    assert (
        loaded.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        == (tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
    )


@pytest.mark.slow
def test_the_character_vocabulary_is_spelled_as_llama_cpp_reads_a_byte_level_bpe(gguf_dir: Path) -> None:
    from gguf import GGUFReader

    fields = GGUFReader(gguf_dir / "demo-f16.gguf").fields

    def strings(key: str) -> list[str]:
        field = fields[key]
        return [bytes(field.parts[i]).decode() for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert len(tokens) == 128 and tokens[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert tokens[4:7] == ["ĉ", "Ċ", "Ġ"]  # tab, newline, space in GPT-2's byte alphabet, ids unchanged
    assert tokens[101] == "[PAD101]" and strings("tokenizer.ggml.merges") == ["<pad> <pad>"]


def _round_trip_tokenizer(tokenizer: Any, folder: Path, texts: list[str]) -> Any:
    """Write a one-layer random Llama with `tokenizer` to GGUF and read the tokenizer back; ids must match."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from zerofit.export.gguf_writer import write_gguf

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=len(tokenizer),
    )
    write_gguf(LlamaForCausalLM(config), tokenizer, folder / "t.gguf", "f16", "t")
    loaded = AutoTokenizer.from_pretrained(folder, gguf_file="t.gguf")
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids, text
        assert loaded.decode(ids) == tokenizer.decode(ids)
    return loaded


def test_a_byte_level_bpe_keeps_its_merges_and_names_its_pre_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from zerofit.export.gguf_tokenizer import gguf_vocab

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(  # Llama 3's split, then bytes
        [
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(Path(DEMO_DATA).read_text().splitlines()[:300], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    vocab = gguf_vocab(tokenizer, len(tokenizer))
    assert (vocab.model, vocab.pre) == ("gpt2", "llama-bpe") and len(vocab.merges) > 10
    _round_trip_tokenizer(
        tokenizer, tmp_path, ["Hello world, 1234 + 5678!", " reverse: abc\n\nxyz  ", "a<|eot_id|>"]
    )


def _chatml_tokenizer() -> Any:
    """A small byte-level BPE shaped as SmolLM2's: bos is `<|im_start|>`, which its ChatML template opens
    every turn with, and encoding adds no bos (no post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(Path(DEMO_DATA).read_text().splitlines()[:300], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return tokenizer


@pytest.mark.parametrize("chat", [True, False])
def test_add_bos_token_says_whether_the_run_trained_with_bos_first(tmp_path: Path, chat: bool) -> None:
    # A chat run trains on the template's rendering, nothing added: a GGUF saying add_bos_token would make
    # llama.cpp (and transformers' reader) open every prompt with a second <|im_start|>. A text run trains
    # with bos first, so its GGUF says so.
    from gguf import GGUFReader
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from zerofit.export.gguf_writer import write_gguf

    tokenizer = _chatml_tokenizer()
    assert tokenizer.encode("add: 1+2") == tokenizer.encode("add: 1+2", add_special_tokens=False)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=len(tokenizer),
    )  # fmt: skip
    write_gguf(LlamaForCausalLM(config), tokenizer, tmp_path / "t.gguf", "f16", "t", chat=chat)
    assert (
        bool(GGUFReader(tmp_path / "t.gguf").fields["tokenizer.ggml.add_bos_token"].parts[-1][0]) is not chat
    )
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "add: 1+2"}], tokenize=False)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id
    assert loaded.encode(rendered) == (ids if chat else [tokenizer.bos_token_id, *ids])


def test_a_sentencepiece_style_bpe_keeps_its_byte_tokens(tmp_path: Path) -> None:
    import string

    from gguf import GGUFReader
    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *string.ascii_letters, *string.digits, *".,:+=!", "▁t", "he", "▁the"]:
        vocab[piece] = len(vocab)
    tokenizer = LlamaTokenizer(vocab=vocab, merges=[("▁", "t"), ("h", "e"), ("▁t", "he")])
    loaded = _round_trip_tokenizer(
        tokenizer, tmp_path, ["the theory 12+3=15!", "Hello World é", " two  spaces"]
    )
    pieces = loaded.convert_ids_to_tokens(loaded.encode("é", add_special_tokens=False))
    assert pieces[-1] == "<0xA9>"  # byte fallback
    fields = GGUFReader(tmp_path / "t.gguf").fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    assert bool(fields["tokenizer.ggml.add_space_prefix"].parts[-1][0])  # "the" -> "▁the", as llama.cpp must


@pytest.mark.slow
def test_the_folder_holds_the_files_a_modelfile_and_the_card(gguf_dir: Path, run_dir: Path) -> None:
    names = {p.name for p in gguf_dir.iterdir()}
    assert names == {*(f"demo-{q}.gguf" for q in TOLERANCE), "Modelfile", "README.md", "zerofit_export.json"}
    info = json.loads((gguf_dir / "zerofit_export.json").read_text())
    assert (info["kind"], info["dtype"], info["file"], info["step"]) == (
        "gguf",
        "q8_0",
        "demo-q8_0.gguf",
        STEPS,
    )
    modelfile = (gguf_dir / "Modelfile").read_text()
    assert "FROM ./demo-q8_0.gguf\n" in modelfile  # the newest export
    assert 'TEMPLATE """{{- range .Messages }}{{ if eq .Role "assistant" }}a: {{ .Content }}</s>' in modelfile
    assert 'PARAMETER stop "</s>"' in modelfile and "PARAMETER num_ctx 512" in modelfile
    card = (gguf_dir / "README.md").read_text()
    assert "library_name: gguf" in card and "ollama create demo -f Modelfile" in card and "q8_0" in card
    # `zerofit generate` samples from the GGUF folder (read back through transformers)
    assert cli(["generate", str(gguf_dir), "--prompt", "12 + 7 =", "--max-new-tokens", "4"]) == 0


@pytest.mark.slow
def test_an_export_folder_belongs_to_one_run(run_dir: Path, gguf_dir: Path, tmp_path: Path) -> None:
    # A GGUF export adds files to its folder: into another run's export (GGUF or hf) it would leave metadata
    # (zerofit_export.json, card, Modelfile) of one run beside weights of another. Refused; nothing changes.
    other = tmp_path / "runs" / "demo"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("checkpoints"))
    hf = export_run(run_dir, tmp_path / "hf").out
    for folder, source in ((gguf_dir, other), (hf, run_dir)):
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        with pytest.raises(ConfigError) as err:
            export_gguf(source, folder, quant="f16")
        kind = "gguf" if folder == gguf_dir else "adapter"
        assert f"--out {folder} holds a {kind} export of {run_dir.resolve()}" in str(err.value)
        assert f"GGUF exports of this run ({source.resolve()}) only: choose another --out" in str(err.value)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize(
    ("template", "eos", "family", "stops"),
    [
        (
            "{{ '<|start_header_id|>' + m['role'] }}",
            "<|end_of_text|>",
            "llama-3",
            ["<|eot_id|>", "<|end_of_text|>"],
        ),
        ("{{ '<|im_start|>' + m['role'] }}", "<|im_end|>", "chatml", ["<|im_end|>"]),
        ("{{ '[INST] ' + m['content'] }}", "</s>", "other", ["</s>"]),
        (None, "</s>", "none", ["</s>"]),
    ],
)
def test_the_modelfile_maps_the_common_chat_templates(
    template: str | None, eos: str, family: str, stops: list[str]
) -> None:
    from types import SimpleNamespace

    from zerofit.export.modelfile import modelfile, ollama_template

    text = modelfile("m-f16.gguf", SimpleNamespace(chat_template=template, eos_token=eos), 131072)
    go, name, _ = ollama_template(template)
    assert name == family and text.startswith("# Ollama Modelfile") and "FROM ./m-f16.gguf\n" in text
    assert ('TEMPLATE """' in text) == (go is not None) and (go is None or f'TEMPLATE """{go}"""' in text)
    assert [line for line in text.splitlines() if line.startswith("PARAMETER stop")] == [
        f'PARAMETER stop "{stop}"' for stop in stops
    ]
    assert "PARAMETER num_ctx 4096" in text  # min(context length, 4096)


@pytest.mark.slow
def test_a_checkpoint_and_the_final_export_of_the_same_step_give_the_same_gguf(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gguf import GGUFReader

    assert (
        cli(["export", str(run_dir), "--format", "gguf", "--quant", "f32", "--out", str(tmp_path / "a")]) == 0
    )
    out = capsys.readouterr().out
    assert "as GGUF f32 from final export adapter/ (step 4)" in out and "ollama create demo" in out
    flags = ["--format", "gguf", "--quant", "f32", "--step", str(STEPS)]
    assert cli(["export", str(run_dir), *flags, "--out", str(tmp_path / "b")]) == 0
    assert "from checkpoint step-4" in capsys.readouterr().out
    a, b = (GGUFReader(tmp_path / x / "demo-f32.gguf") for x in "ab")
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.tensor_type == y.tensor_type and bytes(x.data) == bytes(y.data), x.name


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, no permutation, lm_head tied
        # q_norm / k_norm; head_dim != hidden / heads (128: transformers reads no head_dim for qwen3, 128 is its default)
        ("qwen3", {"head_dim": 128}),
        ("mistral", {}),  # written as llama.cpp's `llama`
    ],
)
def test_other_supported_families_round_trip_exactly(
    model_type: str, extra: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerofit.catalogue.models import TINY_LLAMA_CONFIG
    from zerofit.export.gguf_writer import write_gguf
    from zerofit.models.tiny import build_tokenizer

    keep = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    sizes = {
        k: TINY_LLAMA_CONFIG[k] for k in (*keep, "vocab_size", "max_position_embeddings", "rms_norm_eps")
    }
    config = AutoConfig.for_model(model_type, **sizes, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    write_gguf(model, build_tokenizer(), tmp_path / "m.gguf", "f32", f"tiny-{model_type}")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    # Mistral is llama.cpp's `llama`: transformers reads it back as a Llama (the same computation).
    assert loaded.config.model_type == {"mistral": "llama"}.get(model_type, model_type)
    ids = torch.randint(4, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_an_unsupported_architecture_is_one_paragraph() -> None:
    from transformers import GPT2Config

    from zerofit.export.gguf_writer import check_architecture

    with pytest.raises(ConfigError) as err:
        check_architecture(GPT2Config())
    text = err.value.without_heading()
    assert "the model is a 'gpt2'" in text and "llama, mistral, qwen2, qwen3" in text
    assert "convert_hf_to_gguf.py" in text and "\n" not in text


@pytest.mark.slow
def test_a_type_the_gguf_package_cannot_write_names_the_llama_quantize_command(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q4"
    assert cli(["export", str(run_dir), "--format", "gguf", "--quant", "Q4_K_M", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the gguf package cannot write Q4_K_M" in err
    assert f"`llama-quantize {out}/demo-f16.gguf {out}/demo-q4_k_m.gguf Q4_K_M`" in err
    assert "Traceback" not in err and "\n" not in err.strip()
    assert not out.exists()
    assert cli(["export", str(run_dir), "--format", "gguf", "--quant", "q3", "--out", str(out)]) == 2
    assert "--quant q3: not a GGUF file type; zerofit writes f32, f16, bf16, q8_0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_failed_write_leaves_no_partial_gguf_and_the_earlier_file_intact(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf

    folder = tmp_path / "out"
    export_gguf(run_dir, folder, quant="f16")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def disk_full(self: Any, *args: Any, **kwargs: Any) -> None:
        assert self.fout is not None
        self.fout[0].write(b"\0" * 4096)  # part of the data reached the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_gguf(run_dir, folder, quant="f16")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # no temporary file left either
    with pytest.raises(OSError, match="No space left"):
        export_gguf(run_dir, folder, quant="q8_0")
    assert not (folder / "demo-q8_0.gguf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_llama_cpp_itself_tokenizes_and_computes_as_the_merged_model(
    merged: Any, gguf_dir: Path, quant: str
) -> None:
    import numpy as np

    llama_cpp = pytest.importorskip("llama_cpp", reason="the optional extra gguf-run (llama-cpp-python)")
    reference, tokenizer = merged
    llm = llama_cpp.Llama(
        model_path=str(gguf_dir / f"demo-{quant}.gguf"), n_ctx=128, logits_all=True, verbose=False
    )
    try:
        for prompt in PROMPTS:
            ids = _ids(tokenizer, prompt)
            assert llm.tokenize(prompt.encode(), add_bos=True, special=False) == ids[0].tolist()
            llm.reset()
            llm.eval(ids[0].tolist())
            got = np.asarray(llm.scores[: ids.shape[1]])
            with torch.no_grad():
                want = reference(ids).logits[0].numpy()
            scale = float(np.abs(want).max())
            assert float(np.abs(got - want).max()) <= TOLERANCE[quant] * scale, (quant, prompt)
            assert int(got[-1].argmax()) == _greedy(reference, ids, tokenizer)[0]
    finally:
        llm.close()


def test_every_exported_file_follows_the_umask_and_an_adapter_names_its_base_portably(
    run_dir: Path, merged: Any, tmp_path: Path
) -> None:
    """safetensors writes its file 0600 while the files beside it follow the umask: teammates on a shared
    filesystem could read an export's config but not its weights. And adapter_config.json names this
    machine's cache folder of the built-in base: the export also records the name that resolves elsewhere."""
    import warnings

    from peft import PeftConfig

    manifest = json.loads((run_dir / "checkpoints" / f"step-{STEPS}" / "manifest.json").read_text())
    assert manifest["config_file"] == "demo.yaml"  # what a resume compares: the run's config file
    probe = tmp_path / "probe"
    probe.write_text("")  # a file as open() makes it: the mode the umask gives
    wanted = probe.stat().st_mode & 0o777
    exported = export_run(run_dir, tmp_path / "adapter-export").out
    for folder in (run_dir / "adapter", run_dir.parent / "merged", exported):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir() if p.is_file()}
        assert set(modes.values()) == {oct(wanted)}, (folder, modes)
    for folder in (run_dir / "adapter", exported):
        record = json.loads((folder / "zerofit_base_model.json").read_text())
        with warnings.catch_warnings():
            warnings.simplefilter(
                "error"
            )  # peft warns on keys it does not know: adapter_config.json has none
            local = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
        assert record["base_model"] == "tiny-llama" and record["seed"] == 42
        assert record["local_path"] == local and Path(local).is_dir()
        assert "model.name_or_path=tiny-llama seed=42" in record["note"]
