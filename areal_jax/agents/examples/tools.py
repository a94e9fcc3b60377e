"""What the example agents share: answering a turn's tool calls with the agent's own tool functions, where a
call of an unknown tool, a malformed call or arguments that are not a JSON object become a tool error the
model reads in the next turn."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai

Tool = Callable[[dict[str, Any]], Awaitable[str]]
CONTEXT_FULL = "context_length_exceeded"


async def ask(client: Any, **request: Any) -> Any | None:
    """The assistant message of one chat turn; None once the conversation no longer fits the model's context
    (the proxy answers 400 with code `context_length_exceeded`), which ends the episode."""
    try:
        response = await client.chat.completions.create(model="policy", **request)
    except openai.BadRequestError as err:
        if err.code == CONTEXT_FULL:
            return None
        raise
    return response.choices[0].message


async def answer_calls(message: Any, tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """The tool messages that answer `message.tool_calls` (an openai ChatCompletionMessage), in order."""
    replies = []
    for call in message.tool_calls or ():
        replies.append({"role": "tool", "tool_call_id": call.id, "content": await _run(call.function, tools)})
    return replies


async def _run(function: Any, tools: dict[str, Tool]) -> str:
    tool = tools.get(function.name)
    if tool is None:
        return f"error: no tool {function.name!r}; the tools are {', '.join(sorted(tools))}"
    try:
        arguments = json.loads(function.arguments)
    except json.JSONDecodeError:
        return f"error: the arguments of {function.name} are not JSON: {function.arguments!r}"
    if not isinstance(arguments, dict):
        return f"error: the arguments of {function.name} must be a JSON object, got {function.arguments!r}"
    return await tool(arguments)


def function_tool(name: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAI tool definition whose parameters are all strings (name -> description)."""
    properties = {p: {"type": "string", "description": d} for p, d in parameters.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(parameters)},
        },
    }
