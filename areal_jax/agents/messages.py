"""OpenAI chat messages as the proxy reads them: checked and normalized at the boundary, keyed so that a turn's
history can be matched against the conversations already recorded, and shaped for the chat template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the proxy refuses (HTTP 400); the message names the offending field."""


def content_text(content: Any, where: str) -> str:
    """The text of a message's content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"{where}.content: expected a string or a list of text parts, got {content!r}")


def normalize(message: Any, index: int) -> dict[str, Any]:
    """One request message as {role, content, tool_calls?, tool_call_id?, name?}; the rest is dropped."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise RequestError(f"{where}: expected an object, got {message!r}")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role: got {role!r}; allowed: {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = content_text(message.get("content"), where)
    calls = message.get("tool_calls") or []
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls: only an assistant message carries a list of tool calls")
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where}: expected {{id, type: function, function: {{name, arguments}}}}, got {call!r}")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def key(message: Mapping[str, Any]) -> str:
    """What identifies a normalized message when a later request repeats it (tool-call ids are not compared)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
    return json.dumps([message["role"], message["content"], calls, message.get("tool_call_id")])


def for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages as chat templates read them: tool-call arguments as objects where they parse."""
    out = []
    for message in messages:
        m = dict(message)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c)}} for c in m["tool_calls"]]
        out.append(m)
    return out


def _loads(call: Mapping[str, Any]) -> Any:
    try:
        return json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return call["function"]["arguments"]


def tools_key(tools: Any) -> str:
    """The tool list of a request, checked (a list of {type: function, function: {name, ...}}) and keyed."""
    if tools is None:
        return "null"
    if not isinstance(tools, list):
        raise RequestError(f"tools: expected a list of {{type: function, function: {{name, ...}}}}, got {tools!r}")
    for i, tool in enumerate(tools):
        kind = tool.get("type", "function") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise RequestError(f"tools[{i}].type: got {kind!r}; the proxy takes only 'function' tools")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}].function: expected {{name, parameters?}}, got {function!r}")
    return json.dumps(tools, sort_keys=True)
