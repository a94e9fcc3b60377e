"""The ids that follow a model turn, read off the chat template: one rule for the multi-turn workflow and the
agent proxy, so that neither ever re-tokenizes the model's own output (token in / token out).

The template renders a conversation whose model turn has a placeholder content (`MODEL_MARK`); what it writes
after the placeholder is the end of that turn and, when messages follow, those messages and the generation
prompt. The ids appended after the model's output are that text less the part of the turn's end the model
already produced (its stop token), encoded once.
"""

from __future__ import annotations

from collections.abc import Sequence

from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.environments import Message

_USER_MARK = "@@areal-user@@"
MODEL_MARK = "@@areal-model@@"  # a model turn's placeholder content


class TurnRenderer:
    """Token ids the chat template puts after a model turn: the end of that turn, a user reply, the generation
    prompt. Read off a placeholder conversation rendered as text, after the assistant's placeholder content."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._conversation: list[Message] = [
            {"role": "user", "content": _USER_MARK},
            {"role": "assistant", "content": MODEL_MARK},
        ]
        base = tokenizer.apply_chat_template(self._conversation, add_generation_prompt=False, tokenize=False)
        turn_end = after_model_mark(base)
        if turn_end is None:
            raise ValueError(f"the chat template drops the assistant's content: rendered {base!r}")
        self.turn_end = turn_end
        self._base = base

    def reply_ids(self, reply: str, model_output_ids: Sequence[int]) -> list[int]:
        """Ids to append after `model_output_ids` (which may already hold the start of the turn's end)."""
        full = self.tokenizer.apply_chat_template(
            [*self._conversation, {"role": "user", "content": reply}], add_generation_prompt=True, tokenize=False
        )
        ids = continuation_ids(self.tokenizer, self._base, full, model_output_ids)
        if ids is None:
            raise ValueError(
                f"the chat template ends an assistant turn with {self.turn_end!r} when it is last but not when the "
                f"reply {reply!r} follows: {full!r}"
            )
        return ids


def after_model_mark(rendered: str) -> str | None:
    """The text a chat template put after the last `MODEL_MARK` (the model turn's placeholder content)."""
    at = rendered.rfind(MODEL_MARK)
    return None if at < 0 else rendered[at + len(MODEL_MARK) :]


def continuation_ids(tokenizer: Tokenizer, ended: str, continued: str, produced_ids: Sequence[int]) -> list[int] | None:
    """The ids that follow a model turn whose output was `produced_ids` (token in / token out: never
    re-tokenized), from two renderings of the conversation with `MODEL_MARK` as that turn's content: `ended`
    stops after the turn, `continued` goes on with the next messages. The template's end of the turn less the
    part of it the model already produced (its stop token), then what follows. None when the mark is missing or
    the turn ends differently once messages follow."""
    turn_end, after = after_model_mark(ended), after_model_mark(continued)
    if turn_end is None or after is None or not after.startswith(turn_end):
        return None
    produced = tokenizer.decode(produced_ids, skip_special_tokens=False)
    return tokenizer.encode(after[_overlap(produced, turn_end) :])


def _overlap(text: str, suffix: str) -> int:
    """Length of the longest prefix of `suffix` that `text` ends with."""
    for k in range(len(suffix), 0, -1):
        if text.endswith(suffix[:k]):
            return k
    return 0
