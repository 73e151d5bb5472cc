"""The built-in `tiny-llama`: a random-init Llama and a character-level tokenizer, written once to a cache.

Nothing is downloaded. The model is written as a normal Hugging Face folder (config.json, safetensors
weights, tokenizer files) so every later load goes through `from_pretrained` exactly as a real model
would, and every code path a real 7B model takes (dtype, quantization, LoRA, checkpointing) is exercised.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from zerofit.catalogue import TINY_LLAMA_CONFIG

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
# Bump when the files written by `_build_into` change (the chat template came with 2): the cache folder
# name carries it, so checkouts with an older or newer tiny-llama never share a folder.
FILES_VERSION = 2
# Specials first so their ids match TINY_LLAMA_CONFIG (pad 0, bos 1, eos 2); then tab, newline and the 95
# printable ASCII characters: 101 tokens, within the model's vocab_size of 128.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
CHARACTERS: tuple[str, ...] = ("\t", "\n", *(chr(c) for c in range(32, 127)))

# Files whose presence marks a complete folder (a folder only ever appears complete: see `_build_into`).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> Path:
    """Where zerofit keeps generated artefacts: `$ZEROFIT_CACHE`, default `~/.cache/zerofit`."""
    return Path(os.environ.get("ZEROFIT_CACHE", Path.home() / ".cache" / "zerofit")).expanduser()


def tiny_llama_path(seed: int = 0) -> Path:
    """The folder `ensure_tiny_llama(seed)` builds (it may not exist yet)."""
    return cache_dir() / f"tiny-llama-seed{seed}-v{FILES_VERSION}"


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast (imported lazily: transformers is slow to import)
    """A character-level fast tokenizer over a fixed vocabulary: one token per character, no merges.

    Encoding never adds special tokens by itself (no post-processor): the data pipeline adds bos/eos
    explicitly, so masking is the same for every tokenizer. Characters outside the vocabulary map to <unk>.
    It carries `CHAT_TEMPLATE`, so chat (`messages`) data trains on tiny-llama too.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    assert len(vocab) <= TINY_LLAMA_CONFIG["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split into single characters, keeping each one (including spaces and newlines) as its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Concatenate tokens on decode (the default decoder would join them with spaces).
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_LLAMA_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def _build_into(folder: Path, seed: int) -> None:
    """Write config, seeded random weights and tokenizer into `folder` (which must exist and be empty)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_LLAMA_CONFIG)
    # Seeded init without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def ensure_tiny_llama(seed: int = 0) -> Path:
    """Return the folder of the built-in tiny Llama for `seed`, building it once if needed.

    Safe when several ranks call it at once: each builds into its own temporary folder next to the
    target and renames it into place; whoever loses the race discards its copy (same seed = same bytes).
    """
    target = tiny_llama_path(seed)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _build_into(tmp, seed)
        try:
            os.rename(tmp, target)  # atomic; fails if another process already put a folder there
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
