"""The OpenAI Responses API on the proxy (`POST /v1/responses`), as one chat-completions turn.

A request's `instructions` (a system message first), the conversation of its `previous_response_id` and its
`input` (a string, or items: messages with text parts, `function_call` items, which join the assistant message
before them as its tool calls, and `function_call_output` items, which become tool messages) make the chat
messages; function tools, `tool_choice`, `max_output_tokens`, `temperature`, `top_p` and `seed` (an extension:
the Responses API has none) the rest of the body. The chat route answers it, so the turn is rendered, parsed
and recorded exactly as a chat-completions turn with those messages; its reply becomes a Response: a
`message` item with the text (when there is text or no call) and a `function_call` item per tool call. With
`stream: true` the same Response comes as the API's server-sent events, sent once the turn is done.

Responses are kept (unless `store: false`) while their episode is in flight; ending the episode drops them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from areal_jax.agents import translation as tr
from areal_jax.agents.messages import RequestError
from areal_jax.agents.responses import MODEL_NAME, new_id

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


@dataclasses.dataclass(frozen=True)
class _Stored:
    session_id: str
    conversation: tuple[dict[str, Any], ...]  # chat messages up to and with its reply, its instructions left out


class ResponseStore:
    """Responses by id for `previous_response_id`, each its episode's, dropped when the episode ends (the
    proxy's loop owns it)."""

    def __init__(self) -> None:
        self._responses: dict[str, _Stored] = {}
        self._by_session: dict[str, list[str]] = {}

    def conversation(self, response_id: str) -> tuple[dict[str, Any], ...]:
        stored = self._responses.get(response_id)
        if stored is None:
            raise RequestError(
                f"previous_response_id: no response {response_id!r} is stored (responses are kept while their "
                "episode is in flight, unless sent with store: false)"
            )
        return stored.conversation

    def put(self, response_id: str, session_id: str, conversation: tuple[dict[str, Any], ...]) -> None:
        self._responses[response_id] = _Stored(session_id, conversation)
        self._by_session.setdefault(session_id, []).append(response_id)

    def drop(self, session_id: str) -> None:
        """Forget the responses of an episode that ended."""
        for response_id in self._by_session.pop(session_id, ()):
            del self._responses[response_id]


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    chat: dict[str, Any]  # the chat-completions body
    conversation: list[dict[str, Any]]  # the chat messages without the instructions
    echo: dict[str, Any]  # request fields a Response repeats
    stream: bool
    store: bool


def parse(body: Any, store: ResponseStore) -> ResponsesRequest:
    """A Responses request checked and translated (an unknown `previous_response_id` is a RequestError)."""
    body = tr.body_object(body)
    instructions = tr.optional_str(body, "instructions")
    previous_id = tr.optional_str(body, "previous_response_id")
    history = list(store.conversation(previous_id)) if previous_id is not None else []
    conversation = [*history, *_input(body.get("input"))]
    tools = _tools(body.get("tools"))
    chat: dict[str, Any] = {
        "messages": [*([{"role": "system", "content": instructions}] if instructions else []), *conversation],
        **tr.max_tokens(body, "max_output_tokens", required=False),
        **tr.passed_on(body, "temperature", "top_p", "seed", "user"),
    }
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"), {t["function"]["name"] for t in tools})
    echo = {
        "instructions": instructions,
        "previous_response_id": previous_id,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "parallel_tool_calls": tr.flag(body, "parallel_tool_calls", True),
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
    }
    return ResponsesRequest(chat, conversation, echo, tr.flag(body, "stream", False), tr.flag(body, "store", True))


async def respond(
    request: ResponsesRequest, chat: tr.ChatCall, store: ResponseStore, session_id: str | None
) -> tr.Reply:
    """The Response to `request` (its events when streamed), kept in `store` under the episode `session_id`."""
    answer = await tr.ask(chat, request.chat)
    response = _response(new_id("resp_", 48), request, answer)
    if request.store and session_id is not None:
        store.put(response["id"], session_id, (*request.conversation, answer.message))
    return _events(response) if request.stream else response


def _input(raw: Any) -> list[dict[str, Any]]:
    if isinstance(raw, str) and raw:
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"input: expected a non-empty string or a non-empty list of input items, got {raw!r}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise RequestError(f"{where}: expected an object, got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the calls of the reply the message began
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}.call_id: expected a string, got {call_id!r}")
            out.append(
                {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}
            )
        else:
            raise RequestError(
                f"{where}.type: got {kind!r}; the proxy takes 'message', 'function_call' and 'function_call_output'"
            )
    return out


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role: got {role!r}; allowed: {', '.join(_ROLES)}")
    return {
        "role": "system" if role == "developer" else role,
        "content": _text(item.get("content"), f"{where}.content"),
    }


def _text(content: Any, where: str) -> str:
    """A string, or text parts (`input_text`, `output_text`) joined; other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: expected a string or a list of text parts, got {content!r}")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: expected {{type: input_text or output_text, text}}, got {part!r}")
    return "".join(part["text"] for part in content)


def _call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise RequestError(f"{where}.{field}: expected a string, got {item.get(field)!r}")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(f"tools: expected a list of function tools, got {raw!r}")
    tools = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise RequestError(f"tools[{i}].type: got {kind!r}; the proxy takes only 'function' tools")
        tools.append(
            tr.chat_tool(
                tool.get("name"),
                f"tools[{i}]",
                description=tool.get("description"),
                parameters=tool.get("parameters"),
                strict=tool.get("strict"),
            )
        )
    return tools


def _tool_choice(choice: Any, names: set[str]) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return tr.forced(choice.get("name"), names, "tool_choice")
    raise RequestError(f"tool_choice: expected 'auto', 'none', 'required' or {{type: function, name}}, got {choice!r}")


def _response(response_id: str, request: ResponsesRequest, answer: tr.ChatAnswer) -> dict[str, Any]:
    calls, cut = answer.tool_calls, answer.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    output: list[dict[str, Any]] = []
    if answer.message["content"] or not calls:
        text = {"type": "output_text", "text": answer.message["content"], "annotations": [], "logprobs": []}
        output.append(
            {"type": "message", "id": new_id("msg_", 48), "role": "assistant", "status": status, "content": [text]}
        )
    for call in calls:
        output.append(
            {
                "type": "function_call",
                "id": new_id("fc_", 48),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": MODEL_NAME,
        "output": output,
        "store": request.store,
        **request.echo,
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        },
    }


def _events(response: dict[str, Any]) -> list[bytes]:
    """The Response as the API streams it: created, each output item added and done (text or arguments as one
    delta), then completed (or incomplete)."""
    events: list[bytes] = []

    def emit(kind: str, **payload: Any) -> None:
        events.append(tr.sse(kind, {"type": kind, "sequence_number": len(events), **payload}))

    emit("response.created", response={**response, "status": "in_progress", "output": [], "usage": None})
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            emit(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            )
            (part,) = item["content"]
            emit("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            emit("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
            emit("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", **at, content_index=0, part=part)
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
    return events
