"""Prompt ids of a chat turn: the template's rendering of a fresh conversation, or, for a turn that continues a
recorded one, only the ids that follow the recorded sequence (token in / token out: the model's own ids are
never re-tokenized).

A continuation renders the conversation twice with the last recorded assistant message, once ending there and
once with the new messages after it. If the first is not a prefix of the second, the template rewrites history
when new messages follow (Qwen3 and R1-style templates drop an earlier `<think>`): the continuation *diverges*
and the caller applies `agent.template_rule`. Otherwise the new ids are read off a placeholder conversation
(the assistant's content a marker, as `TurnRenderer` does): the template's end of an assistant turn less the
part of it the model already produced (its stop token), then the new messages and the generation prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from areal_jax.agents.messages import RequestError, for_template
from areal_jax.models.tokenizer import Tokenizer

_MARK = "@@areal-agent-turn@@"


class ChatRenderer:
    """Renders chat turns with `tokenizer`'s chat template (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def fresh(self, messages: Sequence[Mapping[str, Any]], tools: Any) -> list[int]:
        """The whole conversation rendered, ending with the generation prompt."""
        return self.tokenizer.encode(self._text(messages, tools, True))

    def rewrites_history(
        self,
        history: Sequence[Mapping[str, Any]],
        reply: Mapping[str, Any],
        new: Sequence[Mapping[str, Any]],
        tools: Any,
    ) -> bool:
        """Whether the template renders `history` and the model's `reply` differently once `new` follows."""
        head = self._text([*history, reply], tools, False)
        return not self._text([*history, reply, *new], tools, True).startswith(head)

    def delta(
        self,
        history: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        tools: Any,
        produced: Sequence[int],
    ) -> list[int] | None:
        """Ids to append after a recorded sequence that ends with the model's reply (`produced`) to `history` so
        that it continues with the messages `new`; None when the template's end of an assistant turn cannot
        be located (then the turn starts a new sequence)."""
        marked = {"role": "assistant", "content": _MARK}
        turn_end = _after_mark(self._text([*history, marked], tools, False))
        after = _after_mark(self._text([*history, marked, *new], tools, True))
        if turn_end is None or after is None or not after.startswith(turn_end):
            return None
        text = self.tokenizer.decode(produced, skip_special_tokens=False)
        return self.tokenizer.encode(after[_overlap(text, turn_end) :])

    def _text(self, messages: Sequence[Mapping[str, Any]], tools: Any, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                for_template(messages), add_generation_prompt=generation_prompt, tokenize=False, tools=tools
            )
        except (jinja2.TemplateError, ValueError) as err:
            raise RequestError(f"messages: the chat template cannot render them: {err}") from None


def _after_mark(rendered: str) -> str | None:
    at = rendered.rfind(_MARK)
    return None if at < 0 else rendered[at + len(_MARK) :]


def _overlap(text: str, suffix: str) -> int:
    """Length of the longest prefix of `suffix` that `text` ends with."""
    for k in range(len(suffix), 0, -1):
        if text.endswith(suffix[:k]):
            return k
    return 0
