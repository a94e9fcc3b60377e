"""Tool calls in the model's text: Hermes (Qwen2.5/Qwen3 `<tool_call>{json}</tool_call>`) and Llama-3 (a JSON
object `{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`, several joined by `;`).

`parse` splits a completion into its plain content and its tool calls. A call that does not parse (not JSON,
no name, an unterminated block) is still returned, with `error` set: the proxy hands it to the agent as a
call of the tool `MALFORMED_TOOL` whose arguments are the raw text, so the agent answers with a tool error
and the episode goes on. `opening` is the text that forces a call when `tool_choice` requires one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from areal_jax.rollout.agent_config import ToolFormat

MALFORMED_TOOL = "malformed_tool_call"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments as a JSON string (raw text when `error` is set)."""

    name: str
    arguments: str
    error: str | None = None


def resolve_format(tool_format: ToolFormat, chat_template: str) -> ToolFormat:
    """`tool_format` with 'auto' decided from the chat template's text."""
    if tool_format != "auto":
        return tool_format
    return "llama3" if "<|eot_id|>" in chat_template else "hermes"


def parse(text: str, tool_format: ToolFormat) -> tuple[str, list[ToolCall]]:
    """(content without the calls, the calls in order)."""
    if tool_format == "llama3":
        return _parse_llama3(text)
    return _parse_hermes(text)


def opening(tool_format: ToolFormat, name: str | None) -> str:
    """The start of a call the model continues from when `tool_choice` forces one (of tool `name` if given)."""
    if tool_format == "llama3":
        return '{"name": "' + (f'{name}", "parameters": ' if name else "")
    return '<tool_call>\n{"name": "' + (f'{name}", "arguments": ' if name else "")


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls = []
    for match in _HERMES_BLOCK.finditer(text):
        terminated = match.group(0).endswith("</tool_call>")
        calls.append(_call(match.group(1).strip(), "arguments", None if terminated else "unterminated <tool_call>"))
    return _HERMES_BLOCK.sub("", text).strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text.strip(), [ToolCall(MALFORMED_TOOL, body, "<|python_tag|> without a JSON call")] if tagged else []
    pieces = _split_objects(body)
    if pieces is None:
        return "", [_call(body, "parameters", None)]
    return "", [_call(piece, "parameters", None) for piece in pieces]


def _split_objects(body: str) -> list[str] | None:
    """`body` as JSON objects joined by ';' (None when it is not)."""
    decoder = json.JSONDecoder()
    pieces, at = [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        pieces.append(body[at:end])
        at = end
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return pieces


def _call(body: str, arguments_key: str, error: str | None) -> ToolCall:
    try:
        value: Any = json.loads(body)
    except json.JSONDecodeError as err:
        return _malformed(body, error or f"not JSON: {err}")
    if error is not None:
        return _malformed(body, error)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return _malformed(body, 'expected a JSON object with a "name"')
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(value["name"], arguments, f"{arguments_key} is not JSON")
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], json.dumps(arguments), f"{arguments_key} is not a JSON object")
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _malformed(body: str, error: str) -> ToolCall:
    named = _NAME.search(body)
    return ToolCall(named.group(1) if named else MALFORMED_TOOL, body, error)
