"""Prompt ids of a chat turn: the template's rendering of a fresh conversation, or, for a turn that continues a
recorded one, only the ids that follow the recorded sequence (token in / token out: the model's own ids are
never re-tokenized).

A continuation renders the conversation twice with the last recorded assistant message, once ending there and
once with the new messages after it. If the first is not a prefix of the second, the template rewrites history
when new messages follow (Qwen3 and R1-style templates drop an earlier `<think>`): the continuation *diverges*
and the caller applies `agent.template_rule`. Otherwise the new ids are read off a placeholder conversation
(the assistant's content a marker), by the rule the built-in multi-turn workflow uses
(`rollout.turns.continuation_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from areal_jax.agents.messages import RequestError, for_template
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.turns import MODEL_MARK, continuation_ids


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
        marked = {"role": "assistant", "content": MODEL_MARK}
        ended = self._text([*history, marked], tools, False)
        return continuation_ids(self.tokenizer, ended, self._text([*history, marked, *new], tools, True), produced)

    def _text(self, messages: Sequence[Mapping[str, Any]], tools: Any, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                for_template(messages), add_generation_prompt=generation_prompt, tokenize=False, tools=tools
            )
        except (jinja2.TemplateError, ValueError) as err:
            raise RequestError(f"messages: the chat template cannot render them: {err}") from None
