"""The built-in tiny models: `tiny-llama` and one per family (`tiny-qwen3`, `tiny-gemma3`, `tiny-phi3`,
`tiny-mixtral`, ...): random-init models of each family's own transformers class and a character-level
tokenizer carrying the family's chat-template text and chat tokens, written once to a cache.

Nothing is downloaded. The model is written as a normal Hugging Face folder (config.json, safetensors
weights, tokenizer files) so every later load goes through `from_pretrained` exactly as a real model
would, and every code path a real 7B model takes (dtype, quantization, LoRA, checkpointing) is exercised.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from zerofit.catalogue.models import TINY_CONFIGS, TINY_LLAMA
from zerofit.core.cache_dirs import cache_root
from zerofit.core.file_modes import follow_umask
from zerofit.core.progress import progress

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# A chat template for `messages` data: one letter per role, assistant turns end with eos. The
# `{% generation %}` marks tell transformers which tokens are the assistant's (the loss mask).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- 'a: ' -}}{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['role'][0] + ': ' + message['content'] + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'a: ' -}}{%- endif -%}"
)

# Each family's chat format, written as its real template renders it (the tokens, headers and turn ends of
# the family's instruct models), so chat data goes through the data pipeline as it would for the real model.
# ChatML (Qwen3, the Qwen MoEs) and Gemma mark assistant text with `{% generation %}`; Mistral's [INST] and
# Phi-3's `<|user|>` templates are left unmarked, as shipped, so the turn-by-turn mask path (`data/chat.py`)
# runs too. tiny-qwen2 and tiny-llama3 carry their family's real template (tools included), below.
_CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\n' -}}"
    "{%- else -%}{{- message['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
# Gemma has no system role: a system message is prepended to the first user turn; the assistant is `model`.
_GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<start_of_turn>model\n' -}}"
    "{%- generation -%}{{- message['content'] + '<end_of_turn>' -}}{%- endgeneration -%}{{- '\n' -}}"
    "{%- else -%}"
    "{{- '<start_of_turn>user\n' + (first if loop.first else '') + message['content'] + '<end_of_turn>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
_MISTRAL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{- message['content'] + eos_token -}}"
    "{%- else -%}{{- '[INST] ' + message['content'] + ' [/INST]' -}}{%- endif -%}"
    "{%- endfor -%}"
)
# The real templates of the families whose instruct models call tools, kept as the files the models ship
# (models/templates/, copied byte for byte from trl 1.16's trl/chat_templates/, which stores the Hub's own
# for identity comparison): qwen2_5.jinja is Qwen/Qwen2.5-*-Instruct's (tools in the system turn, calls in
# <tool_call> tags, results as <tool_response> in a user turn), llama3_1.jinja meta-llama/Llama-3.1-8B-Instruct's
# (tools in the first user turn, one call per turn as JSON with "parameters", results in an `ipython` turn).
# Neither marks `{% generation %}`: the turn-by-turn mask path (`data/chat.py`) finds the assistant's text.
_TEMPLATES = Path(__file__).with_name("templates")
_QWEN25_TEMPLATE = (_TEMPLATES / "qwen2_5.jinja").read_text(encoding="utf-8")
_LLAMA31_TEMPLATE = (_TEMPLATES / "llama3_1.jinja").read_text(encoding="utf-8")
_PHI3_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)


class TinyFamily:
    """A built-in model's chat format: its template, its chat tokens (added after the characters) and the
    token that ends an assistant turn (the tokenizer's eos, as in the family's instruct models)."""

    def __init__(
        self, template: str, tokens: tuple[str, ...] = (), eos: str = EOS, byte_level: bool = False
    ) -> None:
        self.template, self.tokens, self.eos = template, tokens, eos
        # Qwen2: transformers' AutoTokenizer loads any `qwen2` folder as its own Qwen2Tokenizer (a byte-level
        # BPE, whatever tokenizer_config.json says), which drops a character-level vocab's spaces and
        # newlines: such a family's characters are byte-level symbols ("Ġ" for a space), as in the real one.
        self.byte_level = byte_level


_CHATML = TinyFamily(_CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>"), "<|im_end|>")
_QWEN25 = TinyFamily(_QWEN25_TEMPLATE, ("<|im_start|>", "<|im_end|>"), "<|im_end|>", byte_level=True)
_LLAMA31 = TinyFamily(
    _LLAMA31_TEMPLATE,
    (
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ),
    "<|eot_id|>",
)
_GEMMA = TinyFamily(_GEMMA_TEMPLATE, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>")
_MISTRAL = TinyFamily(_MISTRAL_TEMPLATE, ("[INST]", "[/INST]"))
_PHI3 = TinyFamily(_PHI3_TEMPLATE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>")
FAMILIES: dict[str, TinyFamily] = {
    TINY_LLAMA: TinyFamily(CHAT_TEMPLATE),
    "tiny-llama3": _LLAMA31,
    "tiny-mistral": _MISTRAL,
    "tiny-mixtral": _MISTRAL,
    "tiny-qwen2": _QWEN25,
    "tiny-qwen3": _CHATML,
    "tiny-qwen3-moe": _CHATML,
    "tiny-qwen2-moe": _CHATML,
    "tiny-gemma2": _GEMMA,
    "tiny-gemma3": _GEMMA,
    "tiny-phi3": _PHI3,
}
assert set(FAMILIES) == set(TINY_CONFIGS), "every built-in model has a chat format"

# Bump when the files written by `_build_into` change (the chat template came with 2, tiny-qwen2's and
# tiny-llama3's real templates with 3): the cache folder
# name carries it, so checkouts with an older or newer tiny-llama never share a folder. (The completion
# marker came later without a bump: the model files are byte-identical, and a v2 folder without the
# marker is rebuilt once, in place, with a note.)
FILES_VERSION = 3
# Specials first so their ids match TINY_LLAMA_CONFIG (pad 0, bos 1, eos 2); then tab, newline and the 95
# printable ASCII characters: 101 tokens, within the model's vocab_size of 128.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
CHARACTERS: tuple[str, ...] = ("\t", "\n", *(chr(c) for c in range(32, 127)))

# Files a usable folder must hold. The marker is written last, after all of them, and lists every file
# with its size: a folder without it, or with a listed file missing or of another size, is incomplete.
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
MARKER = "zerofit-complete.json"


def cache_dir() -> Path:
    """Where zerofit keeps generated artefacts (`zerofit.core.cache_dirs.cache_root`)."""
    return cache_root()


def tiny_model_path(name: str = TINY_LLAMA, seed: int = 0) -> Path:
    """The folder `ensure_tiny_model(name, seed)` builds (it may not exist yet)."""
    return cache_dir() / f"{name}-seed{seed}-v{FILES_VERSION}"


def tiny_llama_path(seed: int = 0) -> Path:
    """The folder `ensure_tiny_llama(seed)` builds (it may not exist yet)."""
    return tiny_model_path(TINY_LLAMA, seed)


def build_tokenizer(
    name: str = TINY_LLAMA,
):  # -> transformers.PreTrainedTokenizerFast (imported lazily: slow)
    """A character-level fast tokenizer over a fixed vocabulary: one token per character, no merges.

    Encoding never adds special tokens by itself (no post-processor): the data pipeline adds bos/eos
    explicitly, so masking is the same for every tokenizer. Characters outside the vocabulary map to <unk>.
    It carries the chat template of built-in model `name`'s family, with that family's chat tokens (after
    the characters, as added special tokens, so `<|im_start|>` is one token) and its turn-end token as eos.
    """
    if FAMILIES[
        name
    ].byte_level:  # a family whose real template needs byte-level text (`_byte_level_tokenizer`)
        return _byte_level_tokenizer(name)
    config = TINY_CONFIGS[name]
    return char_tokenizer(FAMILIES[name], config["vocab_size"], config["max_position_embeddings"])


def char_tokenizer(family: TinyFamily, vocab_size: int, max_length: int):  # -> PreTrainedTokenizerFast
    """`build_tokenizer`'s character-level tokenizer for chat format `family` (its template, its chat tokens
    after the characters, its turn-end token as eos), within `vocab_size` ids; the built-in vision-language
    models (`zerofit.models.tiny_vision`) use it with their image tokens among the family's tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS, *family.tokens))}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split into single characters, keeping each one (including spaces and newlines) as its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Concatenate tokens on decode (the default decoder would join them with spaces).
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([*SPECIAL_TOKENS, *family.tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=family.eos,
        unk_token=UNK,
        pad_token=PAD,
        chat_template=family.template,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def _byte_level_tokenizer(name: str):  # -> transformers.Qwen2Tokenizer (imported lazily: slow)
    """`build_tokenizer(name)` for a byte-level family (`TinyFamily.byte_level`): the family's own tokenizer
    class over the same ids, each character's byte-level symbol one token (no merges), so the folder loads
    back through AutoTokenizer as the same tokenizer."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    family, symbol = FAMILIES[name], bytes_to_unicode()
    tokens = (*SPECIAL_TOKENS, *("".join(symbol[b] for b in c.encode()) for c in CHARACTERS), *family.tokens)
    tokenizer = Qwen2Tokenizer(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=[],
        unk_token=UNK,
        bos_token=BOS,
        eos_token=family.eos,
        pad_token=PAD,
        chat_template=family.template,
        model_max_length=TINY_CONFIGS[name]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=True) for t in family.tokens], special_tokens=True)
    return tokenizer


def _build_into(folder: Path, seed: int, name: str = TINY_LLAMA) -> None:
    """Write config, seeded random weights and tokenizer of built-in model `name` into `folder` (which must
    exist and be empty); the model is its family's own transformers class (config.json's `architectures`).

    Every file is written here, whatever the distributed state: `PreTrainedModel.save_pretrained` writes
    nothing on a rank other than 0 once torch.distributed is initialized (`should_save_on_this_rank`), so
    a non-zero rank building through it would produce a folder holding only the tokenizer. The bytes are
    those `save_pretrained` writes for this model (config.json with its dtype, generation_config.json,
    one `model.safetensors` with metadata format=pt; a tied lm_head is stored once, as save_pretrained does).
    """
    import transformers
    from safetensors.torch import save_file

    tokenizer = build_tokenizer(name)
    data = dict(TINY_CONFIGS[name])
    data["eos_token_id"] = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    model_class = getattr(transformers, data["architectures"][0])
    # Seeded init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.config.dtype = str(model.dtype).removeprefix("torch.")  # as save_pretrained records it
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_file(unshared_weights(model), folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    write_marker(folder)


def unshared_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each storage once: a tied output head (Qwen2, Gemma) is the embedding, which
    safetensors refuses to store twice and `from_pretrained` ties back."""
    seen: set[int] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        weights[name] = tensor.contiguous()
    return weights


def write_marker(folder: Path) -> None:
    """Record every file of `folder` and its size in `MARKER`, written last: the folder is now complete.
    Every built-in's files follow the umask first: a shared cache, where safetensors' 0600 would keep other
    users from the weights."""
    follow_umask(folder)
    missing = [name for name in _REQUIRED_FILES if not (folder / name).is_file()]
    if missing:  # a writer skipped a file: never mark such a folder complete
        raise RuntimeError(f"building a built-in model in {folder} wrote no {', '.join(missing)}")
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / MARKER).write_text(json.dumps({"files": files}, indent=2) + "\n")


def incomplete_reason(folder: Path) -> str | None:
    """Why `folder` is not a complete built-in model folder, or None when it is."""
    if not folder.is_dir():
        return "it does not exist"
    missing = [name for name in _REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        return f"no {', '.join(missing)}"
    try:
        files = json.loads((folder / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no {MARKER}, which a finished build writes last"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} missing or not {size} bytes"
    return None


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive cross-process lock for building `folder` (a lock file next to it).

    `flock` is dropped by the kernel when its holder exits, even on SIGKILL, so the lock never goes stale;
    the lock file itself is left in place (deleting it would let two processes lock different files).
    """
    with (folder.parent / f".{folder.name}.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _replace(new: Path, target: Path) -> None:
    """Put folder `new` at `target`, moving an existing (incomplete) `target` aside first and deleting it.

    Readers never see a partial folder at `target`: it is either the old incomplete one (which no reader
    uses), briefly absent, or the new complete one.
    """
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / target.name)
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(new, target)


def build_note(name: str, target: Path) -> str:
    """The one line the process that builds built-in model `name` prints (once per machine, not per run)."""
    return f"zerofit: building {name} once into {target} (the built-in model; later runs reuse it)"


def ensure_tiny_llama(seed: int = 0) -> Path:
    """Return the folder of the built-in tiny Llama for `seed` (`ensure_tiny_model`)."""
    return ensure_tiny_model(TINY_LLAMA, seed)


def ensure_tiny_model(name: str = TINY_LLAMA, seed: int = 0) -> Path:
    """Return the folder of built-in model `name` for `seed`, building it once per machine if needed
    (`build_once`)."""
    return build_once(name, tiny_model_path(name, seed), lambda folder: _build_into(folder, seed, name))


def build_once(name: str, target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, built-in model `name`'s folder, first running `build(empty folder)` once per machine if
    `target` is not complete (`incomplete_reason`); `build` must end with `write_marker`.

    Safe when several processes (the ranks of a launch, or several launches) call it at once: one builds,
    under a lock in the cache folder, into a temporary folder it renames into place; the others wait for
    the lock and then find the folder complete. An incomplete folder (a build that was killed, or one
    written by an older zerofit whose non-zero rank wrote only the tokenizer) is rebuilt, with a note.
    """
    if incomplete_reason(target) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        reason = incomplete_reason(target)
        if reason is None:  # another process built it while this one waited
            return target
        if target.exists():
            print(f"zerofit: {target} was incomplete ({reason}): rebuilding it", file=sys.stderr, flush=True)
        else:
            print(build_note(name, target), flush=True)
        # Temporary folders of builds that were killed (nobody else builds while this lock is held).
        for stale in target.parent.glob(f".{target.name}.*-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            with progress(f"building {name}"):  # the conversion of a GGUF reports inside it
                build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it 0700: other users sharing the cache read the model too
            _replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
