"""What the Responses and Messages routes (`responses_api.py`, `messages_api.py`) share: each translates its
request into one chat-completions body, has the chat route answer it (the same template rendering, tool-call
parsing and token records), and translates the answer back. Here: the call into the chat route, the reply read
back as the normalized message the session recorded, field checks that name the offending field, and
server-sent events."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from areal_jax.agents import messages as msgs
from areal_jax.agents.messages import RequestError

# the chat route answering one chat-completions body (never streamed) with its chat.completion object
ChatCall = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# what a translated route answers: a JSON object, or server-sent events sent together once the turn is done
Reply = dict[str, Any] | list[bytes]


@dataclasses.dataclass(frozen=True)
class ChatAnswer:
    """One sample of a chat completion: the assistant message as the session recorded it (normalized: content a
    string, tool calls with their ids), the chat finish reason, and the token counts."""

    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls", ()))


async def ask(chat: ChatCall, body: dict[str, Any]) -> ChatAnswer:
    """The chat route's answer to `body` (one sample)."""
    completion = await chat({**body, "stream": False})
    (choice,) = completion["choices"]
    usage = completion["usage"]
    return ChatAnswer(
        msgs.normalize(choice["message"], 0),
        choice["finish_reason"],
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def body_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got {body!r}")
    return body


def optional_str(body: Mapping[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{field}: expected a string, got {value!r}")
    return value


def flag(body: Mapping[str, Any], field: str, default: bool) -> bool:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{field}: expected true or false, got {value!r}")
    return value


def max_tokens(body: Mapping[str, Any], field: str, required: bool) -> dict[str, int]:
    """The chat body's `max_tokens` from the request's `field` (checked here, so the error names `field`)."""
    value = body.get(field)
    if value is None and not required:
        return {}
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(f"{field}: expected an integer >= 1, got {value!r}")
    return {"max_tokens": value}


def passed_on(body: Mapping[str, Any], *fields: str) -> dict[str, Any]:
    """The sampling fields named alike in both APIs, left to the chat route's checks."""
    return {field: body[field] for field in fields if body.get(field) is not None}


def chat_tool(name: Any, where: str, **function: Any) -> dict[str, Any]:
    """A function tool in the chat form; the fields given as None are left out."""
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name: expected a non-empty string, got {name!r}")
    return {"type": "function", "function": {"name": name, **{k: v for k, v in function.items() if v is not None}}}


def forced(name: Any, names: set[str], where: str) -> dict[str, Any]:
    """The chat tool choice that forces a call of `name`, one of the request's tools."""
    if name not in names:
        raise RequestError(f"{where}.name: expected one of the tools {sorted(names)}, got {name!r}")
    return {"type": "function", "function": {"name": name}}


def sse(event: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n".encode()
