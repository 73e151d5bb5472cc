"""A run's tokenizer as llama.cpp reads it from a GGUF file: the vocabulary in id order, each token's type,
the merges (or SentencePiece scores), the special ids and the chat template.

llama.cpp knows two tokenizer families (`tokenizer.ggml.model`), and every tokenizer zerofit exports is
written as one of them, with the ids unchanged:

    gpt2    byte-level BPE (Llama 3, Qwen 2/3): tokens in GPT-2's byte alphabet, the merges, and the
            pre-tokenizer's name (`tokenizer.ggml.pre`: llama.cpp splits text with the regex it names)
    llama   SentencePiece-style BPE with byte fallback (Llama 2, Mistral): tokens with scores, byte tokens
            `<0xNN>` typed BYTE; read through gguf's own `LlamaHfVocab`, as llama.cpp's converter does

The built-in tiny-llama's character-level vocabulary (a `WordLevel` model: one token per character) is a
byte-level BPE with no merges: every printable ASCII character is its own byte, so each character stays one
token with its id. llama.cpp's BPE loader requires a merges list and GGUF cannot store an empty array, so the
vocabulary gets one merge that can never apply (`<pad> <pad>`, whose result takes an unused id: a merge
joins two symbols of plain text, and `<pad>` is never one). Ids the tokenizer leaves unused up to the
model's vocab_size are written as `[PADn]` tokens of type UNUSED, as llama.cpp's converter writes them.
(A character outside tiny-llama's 97 has no token: the Hugging Face tokenizer maps it to `<unk>`, llama.cpp's
BPE drops it; the model never saw one either.)
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError

__all__ = ["GGUFVocab", "gguf_vocab", "write_vocab"]

# llama.cpp's token types (gguf.TokenType), spelled here so the module imports without gguf.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# The pre-tokenizer names llama.cpp's converter writes for the common regexes (others: transformers' name).
_PREFERRED_PRE = ("llama-bpe", "qwen2")


@dataclass(frozen=True)
class GGUFVocab:
    """What `write_vocab` writes under `tokenizer.ggml.*`."""

    model: str  # "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre (byte-level BPE only)
    tokens: list[str | bytes]
    token_types: list[int]
    scores: list[float] | None  # SentencePiece only
    merges: list[str]  # byte-level BPE only: "left right"


def _backend(tokenizer: Any) -> dict[str, Any]:
    """The fast tokenizer's own description (tokenizer.json's content): model, pre-tokenizer, merges."""
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _unused(i: int) -> str:
    """The text of an id no token holds, as llama.cpp's converter spells it."""
    return f"[PAD{i}]"


def _byte_spelling(token: str) -> str:
    """`token` in GPT-2's byte alphabet (a space is `Ġ`, a newline `Ċ`), as a byte-level vocabulary spells it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _typed_tokens(tokenizer: Any, vocab_size: int, spell: Any) -> tuple[list[str | bytes], list[int]]:
    """The vocabulary in id order, `vocab_size` long: added tokens CONTROL (special) or USER_DEFINED, the
    others NORMAL spelled by `spell`, gaps UNUSED."""
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder  # id -> AddedToken
    if max(by_id, default=-1) >= vocab_size:
        raise ConfigError(
            [
                f"the tokenizer has ids up to {max(by_id)} but the model's vocab_size is {vocab_size}: the "
                "embedding matrix has no row for them, so no GGUF reader could use them; export the tokenizer "
                "the run trained with (an edited tokenizer folder?)"
            ]
        )
    tokens: list[str | bytes] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(_unused(i))
            types.append(UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(spell(by_id[i]))
            types.append(NORMAL)
    return tokens, types


def _character_vocab(tokenizer: Any, vocab_size: int) -> GGUFVocab:
    """tiny-llama's one-token-per-character vocabulary as a byte-level BPE without merges (module docstring)."""
    tokens, types = _typed_tokens(tokenizer, vocab_size, _byte_spelling)
    normal = [t for t, k in zip(tokens, types, strict=True) if k == NORMAL]
    if any(len(str(t)) != 1 for t in normal):
        raise ConfigError(
            [
                "the tokenizer is a WordLevel vocabulary with multi-character tokens, which neither of "
                "llama.cpp's tokenizer kinds can represent; only a character-level one (as tiny-llama's) exports"
            ]
        )
    pad = tokenizer.pad_token or tokenizer.eos_token
    free = [i for i, k in enumerate(types) if k == UNUSED]
    if not free or pad is None:
        raise ConfigError(
            [
                "the character-level vocabulary needs one unused id below the model's vocab_size (llama.cpp's "
                "BPE loader wants a merges list, and the one merge that never applies takes an id); it has none"
            ]
        )
    tokens[free[-1]] = pad + pad  # the merge's result: never produced, as its halves never meet in text
    return GGUFVocab("gpt2", "default", tokens, types, None, [f"{pad} {pad}"])


def _pre_name(pre_tokenizer: dict[str, Any] | None) -> str:
    """`tokenizer.ggml.pre` for a byte-level tokenizer: the name llama.cpp (and transformers' GGUF reader)
    give the split regex of this pre-tokenizer."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    steps = (pre_tokenizer or {}).get("pretokenizers") or [pre_tokenizer or {}]
    regexes = [
        s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})
    ]
    if not regexes and any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        return "default"  # GPT-2's own split: llama.cpp's default BPE pre-tokenizer
    names = [name for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items() if regexes and regex == regexes[0]]
    for name in (*_PREFERRED_PRE, *names):
        if name in names:
            return name
    what = repr(regexes[0]) if regexes else json.dumps(pre_tokenizer)
    raise ConfigError(
        [
            f"the tokenizer splits text with {what}, a pre-tokenizer "
            "llama.cpp has no name for, so a GGUF of it would tokenize differently in llama.cpp; supported: "
            f"GPT-2's byte-level split and {', '.join(sorted(GGUF_PRE_TOKENIZER_SPLITS))}. Export with "
            "--format hf and convert with llama.cpp's convert_hf_to_gguf.py"
        ]
    )


def _merges(model: dict[str, Any]) -> list[str]:
    """BPE merges as GGUF stores them, `left right` (tokenizer.json holds pairs or such strings)."""
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _sentencepiece_vocab(tokenizer: Any, vocab_size: int) -> GGUFVocab:
    """Llama 2 / Mistral style: through gguf's `LlamaHfVocab` (which reads a saved tokenizer.json)."""
    from gguf.vocab import LlamaHfVocab

    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        entries = list(LlamaHfVocab(Path(folder)).all_tokens())
    tokens: list[str | bytes] = [text for text, _, _ in entries]
    scores = [float(score) for _, score, _ in entries]
    types = [int(kind) for _, _, kind in entries]
    for i in range(len(tokens), vocab_size):
        tokens.append(_unused(i))
        scores.append(-1000.0)
        types.append(UNUSED)
    return GGUFVocab("llama", None, tokens[:vocab_size], types[:vocab_size], scores[:vocab_size], [])


def gguf_vocab(tokenizer: Any, vocab_size: int) -> GGUFVocab:
    """The GGUF form of `tokenizer` for a model of `vocab_size` embedding rows; `ConfigError` for a
    tokenizer llama.cpp cannot represent."""
    backend = _backend(tokenizer)
    model = backend.get("model", {})
    kind = model.get("type")
    if kind == "WordLevel":
        return _character_vocab(tokenizer, vocab_size)
    if kind == "BPE" and model.get("byte_fallback"):
        return _sentencepiece_vocab(tokenizer, vocab_size)
    if kind == "BPE":
        tokens, types = _typed_tokens(tokenizer, vocab_size, lambda t: t)  # already byte-spelled
        return GGUFVocab("gpt2", _pre_name(backend.get("pre_tokenizer")), tokens, types, None, _merges(model))
    raise ConfigError(
        [
            f"the tokenizer is a {kind} model, which zerofit cannot write as a GGUF vocabulary (supported: "
            "byte-level BPE, SentencePiece-style BPE with byte fallback, tiny-llama's characters); export with "
            "--format hf and convert with llama.cpp's convert_hf_to_gguf.py"
        ]
    )


def bos_first(tokenizer: Any, chat: bool) -> bool:
    """Whether the sequences a run trained on start with bos, which GGUF's `add_bos_token` tells llama.cpp.

    Text and prompt/response data: yes where the tokenizer has a bos token (the data pipeline adds it,
    whatever the tokenizer does). Chat messages (`chat`): the template's rendering, nothing added, so what
    the tokenizer itself does, as llama.cpp's converter records it (SmolLM2: no; its bos is `<|im_start|>`,
    which would otherwise open every prompt twice; Llama 3: yes, and llama.cpp drops the template's own).
    """
    if tokenizer.bos_token_id is None:
        return False
    if not chat:
        return True
    return tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]


def write_vocab(writer: Any, vocab: GGUFVocab, tokenizer: Any, chat: bool = False) -> None:
    """Add `vocab`, the special ids and the chat template to gguf writer `writer`; `add_bos_token` as the
    run trained (`bos_first`: `chat` for a run on chat messages)."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    ids = {
        writer.add_bos_token_id: tokenizer.bos_token_id,
        writer.add_eos_token_id: tokenizer.eos_token_id,
        writer.add_unk_token_id: tokenizer.unk_token_id,
        writer.add_pad_token_id: tokenizer.pad_token_id,
    }
    for add, token_id in ids.items():
        if token_id is not None:
            add(int(token_id))
    writer.add_add_bos_token(bos_first(tokenizer, chat))
    writer.add_add_eos_token(False)
    if vocab.model == "llama":
        # SentencePiece's prefix space (Llama 2 / Mistral: yes), as the tokenizer behaves: does "a" become "▁a"?
        first = tokenizer.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))[0]
        writer.add_add_space_prefix(first.startswith("\u2581"))
    template = tokenizer.chat_template
    if isinstance(template, str) and template:
        writer.add_chat_template(template)
