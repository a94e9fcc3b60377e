"""Anthropic's Messages API on the proxy (`POST /v1/messages`), as one chat-completions turn.

`system` (a string or text blocks) becomes the first chat message. Each message's content is a string or
blocks: an assistant's `text` blocks are its content and its `tool_use` blocks its tool calls; a user's
`tool_result` blocks become tool messages and its `text` blocks a user message, in their order. Tools
(`name`, `description`, `input_schema`), `tool_choice` (auto, any, none, tool), `max_tokens` (required, as in
the API), `stop_sequences`, `temperature`, `top_p` and `seed` (an extension: the API has none) make the rest of
the chat body; `top_k` is refused (the trainer scores the rollout's sampling). The chat route answers it, so the
turn is rendered, parsed and recorded exactly as a chat-completions turn with those messages; the reply comes
back as a Message: a `text` block (when there is text or no call) and a `tool_use` block per call, or, with
`stream: true`, as the API's server-sent events, sent once the turn is done.

A tool call whose arguments are not a JSON object (a malformed call of the random or untrained model) comes as
`tool_use` with input `{"_raw_arguments": "<the text>"}`; sent back, it is the same call, so the turn
continues the recorded tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from areal_jax.agents import translation as tr
from areal_jax.agents.messages import RequestError, content_text
from areal_jax.agents.responses import MODEL_NAME, new_id

RAW_ARGUMENTS = "_raw_arguments"
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def parse(body: Any) -> tuple[dict[str, Any], bool]:
    """A Messages request checked and translated: (the chat-completions body, whether to stream)."""
    body = tr.body_object(body)
    if body.get("top_k") is not None:
        raise RequestError(
            f"top_k: got {body['top_k']!r}; the proxy samples as rollout.workflow.sampling says (the trainer scores "
            "that distribution); leave it out"
        )
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"messages: expected a non-empty list, got {raw!r}")
    system = _system(body.get("system"))
    messages = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(raw):
        messages.extend(_message(message, f"messages[{i}]"))
    stop = body.get("stop_sequences")
    if not isinstance(stop, list | None) or not all(isinstance(s, str) and s for s in stop or ()):
        raise RequestError(f"stop_sequences: expected a list of non-empty strings, got {stop!r}")
    chat: dict[str, Any] = {
        "messages": messages,
        **tr.max_tokens(body, "max_tokens", required=True),
        **tr.passed_on(body, "temperature", "top_p", "seed"),
        **({"stop": stop} if stop else {}),
        **_user_id(body.get("metadata")),
    }
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body.get("tool_choice"), {t["function"]["name"] for t in tools})
    return chat, tr.flag(body, "stream", False)


async def respond(chat_body: dict[str, Any], stream: bool, chat: tr.ChatCall) -> tr.Reply:
    """The Message answering `chat_body` (its events when streamed)."""
    answer = await tr.ask(chat, chat_body)
    message = _response(answer)
    return _events(message) if stream else message


def _system(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise RequestError(f"system: expected a string or a list of text blocks, got {system!r}")
    return "".join(_block_text(block, f"system[{j}]") for j, block in enumerate(system))


def _user_id(metadata: Any) -> dict[str, Any]:
    """`metadata.user_id` as the chat body's `user`, which can name the episode."""
    user = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    return {"user": user} if isinstance(user, str) and user else {}


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(message, Mapping):
        raise RequestError(f"{where}: expected an object, got {message!r}")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise RequestError(f"{where}.role: got {role!r}; allowed: user, assistant")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: expected a string or a list of content blocks, got {content!r}")
    return _assistant(content, where) if role == "assistant" else _user(content, where)


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}.content[{j}]", ("text", "tool_use"))
        if kind == "text":
            texts.append(_block_text(block, f"{where}.content[{j}]"))
            continue
        for field in ("id", "name"):
            if not isinstance(block.get(field), str):
                raise RequestError(f"{where}.content[{j}].{field}: expected a string, got {block.get(field)!r}")
        arguments = _arguments(block.get("input"), f"{where}.content[{j}].input")
        calls.append(
            {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
        )
    return [{"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}]


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if _kind(block, at, ("text", "tool_result")) == "text":
            text = _block_text(block, at)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
            continue
        if not isinstance(block.get("tool_use_id"), str):
            raise RequestError(f"{at}.tool_use_id: expected a string, got {block.get('tool_use_id')!r}")
        result = content_text(block.get("content"), at)
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    return out


def _kind(block: Any, where: str, kinds: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind not in kinds:
        raise RequestError(f"{where}.type: got {kind!r}; the proxy takes {' and '.join(kinds)} blocks here")
    return kind


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, Mapping) or block.get("type", "text") != "text" or not isinstance(block.get("text"), str):
        raise RequestError(f"{where}: expected a text block {{type: text, text}}, got {block!r}")
    return block["text"]


def _arguments(tool_input: Any, where: str) -> str:
    """A `tool_use` input as the call's arguments text (the inverse of `_input`)."""
    if not isinstance(tool_input, Mapping):
        raise RequestError(f"{where}: expected an object, got {tool_input!r}")
    if set(tool_input) == {RAW_ARGUMENTS} and isinstance(tool_input[RAW_ARGUMENTS], str):
        return tool_input[RAW_ARGUMENTS]
    return json.dumps(tool_input, ensure_ascii=False)


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a `tool_use` input: the JSON object when it reads back as the same text, else the
    text under RAW_ARGUMENTS."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict) and json.dumps(value, ensure_ascii=False) == arguments:
        return value
    return {RAW_ARGUMENTS: arguments}


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(f"tools: expected a list of tools {{name, description, input_schema}}, got {raw!r}")
    tools = []
    for i, tool in enumerate(raw):
        kind = tool.get("type", "custom") if isinstance(tool, Mapping) else None
        if kind != "custom":
            raise RequestError(f"tools[{i}].type: got {kind!r}; the proxy takes only client tools (type 'custom')")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise RequestError(f"tools[{i}].input_schema: expected a JSON schema object, got {schema!r}")
        tools.append(
            tr.chat_tool(tool.get("name"), f"tools[{i}]", description=tool.get("description"), parameters=schema)
        )
    return tools


def _tool_choice(choice: Any, names: set[str]) -> Any:
    kind = choice.get("type") if isinstance(choice, Mapping) else choice
    if kind in (None, "auto", "any", "none"):
        return {None: "auto", "auto": "auto", "any": "required", "none": "none"}[kind]
    if kind == "tool" and isinstance(choice, Mapping):
        return tr.forced(choice.get("name"), names, "tool_choice")
    raise RequestError(f"tool_choice: expected {{type: auto, any, none or tool (with name)}}, got {choice!r}")


def _response(answer: tr.ChatAnswer) -> dict[str, Any]:
    calls = answer.tool_calls
    content: list[dict[str, Any]] = []
    if answer.message["content"] or not calls:
        content.append({"type": "text", "text": answer.message["content"]})
    for call in calls:
        function = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": _input(function["arguments"])}
        )
    return {
        "id": new_id("msg_", 24),
        "type": "message",
        "role": "assistant",
        "model": MODEL_NAME,
        "content": content,
        "stop_reason": _STOP_REASONS.get(answer.finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
    }


def _events(message: dict[str, Any]) -> list[bytes]:
    """The Message as the API streams it: message_start, each block's start, one delta and stop, message_delta
    (the stop reason and output tokens), message_stop."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    events = [tr.sse("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            empty, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            empty, delta = (
                {**block, "input": {}},
                {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            )
        events.append(
            tr.sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": empty})
        )
        events.append(tr.sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        events.append(tr.sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append(tr.sse("message_delta", {"type": "message_delta", "delta": stop, "usage": usage}))
    events.append(tr.sse("message_stop", {"type": "message_stop"}))
    return events
