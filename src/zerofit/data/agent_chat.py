"""A multi-turn trajectory's tokens through the chat template: the first prompt with the tools, and the tokens
that follow a sampled assistant turn (tool replies, an environment's messages, the next generation prompt).

The policy's own tokens are never re-rendered: a trajectory is the prompt's ids, then each turn's sampled ids
as sampled, then the template's text that follows that turn. That text is found by rendering the
conversation with the assistant turn replaced by a marker (`_MARK`) and the new messages after it, with the
generation prompt: what follows the marker, less the turn-end token the policy already sampled (the eos),
is tokenized without special tokens added. So the template decides every non-sampled token, and the
sampled ones are exactly what the loss trains on.

A template with a tools section gets the tool schemas through `tools=`; one without (the fallback of
`zerofit.objectives.grpo.tool_calls`) gets them as a system turn, merged before an existing system message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerofit.core.errors import DataError
from zerofit.data.chat import _render
from zerofit.objectives.grpo.tool_calls import fallback_system_text, template_format

__all__ = ["AgentChat"]

_MARK = "\u241fzerofit-turn\u241f"  # stands for the sampled turn while rendering; never in real text


class AgentChat:
    """The chat template of a run's tokenizer, as the turn loop renders through it."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]], end_ids: Sequence[int]) -> None:
        self.tokenizer, self.schemas = tokenizer, schemas
        self.format, self.native = template_format(getattr(tokenizer, "chat_template", None))
        self.end_texts = sorted({tokenizer.decode([i]) for i in end_ids} - {""}, key=len, reverse=True)

    def _with_tools(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` with the fallback's system turn first (a template with a tools section: unchanged)."""
        if self.native or not self.schemas:
            return messages
        text = fallback_system_text(self.schemas)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def _text(self, messages: list[dict[str, Any]], where: str) -> str:
        tools = self.schemas if self.native and self.schemas else None
        return _render(
            self.tokenizer,
            self._with_tools(messages),
            where,
            tokenize=False,
            add_generation_prompt=True,
            tools=tools,
        )

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, messages: list[dict[str, Any]], where: str) -> list[int]:
        """The first prompt's ids: `messages` rendered with the tools and the generation prompt."""
        return self._ids(self._text(messages, where))

    def after_turn(
        self, history: list[dict[str, Any]], new: list[dict[str, Any]], ended: bool, where: str
    ) -> list[int]:
        """The ids that follow a sampled assistant turn (`history` is the conversation before it): the
        template's text after that turn, with `new` messages and the next generation prompt; `ended`: the
        sampled turn ended with an end token, which the template's own turn end then replaces."""
        messages = [*history, {"role": "assistant", "content": _MARK}, *new]
        text = self._text(messages, where)
        if text.count(_MARK) != 1:
            raise DataError(
                f"{where}: the chat template does not render an assistant turn's text as it is, so the "
                "sampled tokens cannot be placed in the conversation; use a template that writes each "
                "assistant message's content (data.chat_template)."
            )
        tail = text.split(_MARK, 1)[1]
        for end in self.end_texts if ended else ():
            if tail.startswith(end):
                tail = tail[len(end) :]
                break
        return self._ids(tail)
