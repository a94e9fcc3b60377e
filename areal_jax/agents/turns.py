"""One turn of an episode: the prompt ids it generates from (continuing a recorded sequence where it can, under
`agent.template_rule` where the template diverges), and the assistant messages and sequences its samples
become. Pure functions of the session's records; the proxy's loop thread calls them."""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_jax.agents import messages as msgs
from areal_jax.agents import responses, tool_calls
from areal_jax.agents.prompts import ChatRenderer
from areal_jax.agents.requests import ChatRequest, CompletionRequest
from areal_jax.agents.sessions import Session, TokenSequence
from areal_jax.inference.requests import GenerationResult
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.agent_config import TemplateRule, ToolFormat


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """The sequence a turn continues (None: a new one), the context ids after it (the whole prompt for a new
    sequence, a forced tool-call opening included), and whether the template diverged."""

    parent: TokenSequence | None
    context: list[int]
    opening: list[int]
    diverged: bool

    def prompt_ids(self) -> list[int]:
        return [*(self.parent.ids if self.parent is not None else ()), *self.context]


def plan_chat(
    session: Session, request: ChatRequest, renderer: ChatRenderer, rule: TemplateRule, fmt: ToolFormat
) -> TurnPlan:
    opening = _opening(renderer.tokenizer, request, fmt)
    parent = session.chat_parent(request.conversation, request.tools_key)
    diverged = False
    if parent is not None:
        history, reply = list(parent.messages[:-1]), parent.messages[-1]
        new = request.messages[len(parent.conversation) :]
        diverged = renderer.rewrites_history(history, reply, new, request.tools)
        delta = renderer.delta(history, new, request.tools, parent.produced)
        if delta is not None and not (diverged and rule == "split"):
            return TurnPlan(parent, [*delta, *opening], opening, diverged)
    return TurnPlan(None, [*renderer.fresh(request.messages, request.tools), *opening], opening, diverged)


def plan_completion(session: Session, request: CompletionRequest, tokenizer: Tokenizer) -> TurnPlan:
    if isinstance(request.prompt, list):
        parent = session.ids_parent(request.prompt)
        start = len(parent.ids) if parent is not None else 0
        return TurnPlan(parent, list(request.prompt[start:]), [], False)
    for seq in sorted(session.sequences, key=lambda s: -len(s.ids)):
        text = tokenizer.decode(seq.ids, skip_special_tokens=False)
        if len(text) < len(request.prompt) and request.prompt.startswith(text):
            return TurnPlan(seq, tokenizer.encode(request.prompt[len(text) :]), [], False)
    return TurnPlan(None, tokenizer.encode(request.prompt), [], False)


def _opening(tokenizer: Tokenizer, request: ChatRequest, fmt: ToolFormat) -> list[int]:
    if request.tool_choice == "required" or request.tool_choice == "function":
        return tokenizer.encode(tool_calls.opening(fmt, request.forced_tool))
    return []


def chat_reply(
    tokenizer: Tokenizer, request: ChatRequest, plan: TurnPlan, result: GenerationResult, fmt: ToolFormat
) -> dict[str, Any]:
    """The assistant message of one sample, normalized (what the client is expected to send back)."""
    text = tokenizer.decode([*plan.opening, *result.output_ids], skip_special_tokens=True)
    if request.tool_choice in (None, "none"):
        return {"role": "assistant", "content": text}
    content, calls = tool_calls.parse(text, fmt)
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        reply["tool_calls"] = [
            {
                "id": responses.new_id("call_", 24),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return reply


def record_chat(
    session: Session, request: ChatRequest, plan: TurnPlan, result: GenerationResult, reply: dict[str, Any]
) -> None:
    parent = plan.parent or TokenSequence()
    child = parent.extended(
        plan.context,
        result,
        conversation=(*request.conversation, msgs.key(reply)),
        messages=(*request.messages, reply),
        tools_key=request.tools_key,
        divergences=parent.divergences + plan.diverged,
    )
    session.add(plan.parent, child)


def record_completion(session: Session, plan: TurnPlan, result: GenerationResult) -> None:
    parent = plan.parent or TokenSequence()
    session.add(plan.parent, parent.extended(plan.context, result, conversation=(), messages=()))
