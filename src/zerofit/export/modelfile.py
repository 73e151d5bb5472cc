"""The Ollama `Modelfile` beside a GGUF export, so `ollama create NAME -f Modelfile` is the only step left.

Ollama's TEMPLATE is a Go template over `.Messages`, not the Jinja chat template the GGUF carries, so the
common families are mapped here by a marker of their Jinja text (a stated mapping, not a translator):

    llama-3     `<|start_header_id|>`   header / `<|eot_id|>` turns, stop `<|eot_id|>`
    chatml      `<|im_start|>`          (Qwen 2/3 and many fine-tunes), stop `<|im_end|>`
    tiny-llama  zerofit's own template  `u: ...` / `a: ...</s>` lines, stop `</s>`

Another template gets no TEMPLATE line: Ollama then picks one itself from the GGUF's
`tokenizer.chat_template` (its own list of known templates). No template writes BOS: llama.cpp adds it
where the GGUF's `add_bos_token` says the run trained with it (a chat run on a ChatML model, whose bos is
`<|im_start|>`, gets none). The stop tokens are the template's turn end and the tokenizer's eos.
"""

from __future__ import annotations

from typing import Any

from zerofit.models.tiny import CHAT_TEMPLATE as TINY_CHAT_TEMPLATE

__all__ = ["modelfile", "ollama_template"]

_LLAMA3 = (
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
    "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
_CHATML = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
# tiny-llama's Jinja: an assistant turn is `a: ` + content + eos, any other `<first letter of the role>: `
# + content + newline; the generation prompt is `a: `.
_TINY = (
    '{{- range .Messages }}{{ if eq .Role "assistant" }}a: {{ .Content }}</s>'
    "{{ else }}{{ slice .Role 0 1 }}: {{ .Content }}\n{{ end }}{{ end }}a: "
)


def ollama_template(chat_template: str | None) -> tuple[str | None, str, list[str]]:
    """(Go template or None, the family's name, its stop strings) for Jinja `chat_template`."""
    if not chat_template:
        return None, "none", []
    if chat_template == TINY_CHAT_TEMPLATE:
        return _TINY, "tiny-llama", []
    if "<|start_header_id|>" in chat_template:
        return _LLAMA3, "llama-3", ["<|eot_id|>"]
    if "<|im_start|>" in chat_template:
        return _CHATML, "chatml", ["<|im_end|>"]
    return None, "other", []


def modelfile(gguf_name: str, tokenizer: Any, context_length: int) -> str:
    """The Modelfile text for GGUF file `gguf_name` (beside it) of a model with `tokenizer`."""
    template, family, stops = ollama_template(tokenizer.chat_template)
    if tokenizer.eos_token and tokenizer.eos_token not in stops:
        stops.append(tokenizer.eos_token)
    lines = [
        "# Ollama Modelfile written by `zerofit export --format gguf`: ollama create NAME -f Modelfile",
        f"FROM ./{gguf_name}",
        "",
    ]
    if template is not None:
        lines += [
            f"# the chat template ({family}) in Ollama's Go-template syntax",
            f'TEMPLATE """{template}"""',
            "",
        ]
    elif family == "other":
        lines += [
            "# no TEMPLATE: the chat template is none zerofit maps (llama-3, chatml, tiny-llama); Ollama picks",
            "# one from the GGUF's tokenizer.chat_template, or write one: https://ollama.com/docs/template",
            "",
        ]
    else:
        lines += ["# no chat template: prompts go to the model as they are (a completion model)", ""]
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    lines += [
        "PARAMETER temperature 0.7",
        "PARAMETER top_p 0.9",
        f"PARAMETER num_ctx {min(int(context_length), 4096)}",
    ]
    return "\n".join(lines) + "\n"
