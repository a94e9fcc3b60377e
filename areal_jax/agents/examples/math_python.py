"""A math agent with a Python tool: the model may run code (in the code reward's sandbox) before it answers.
The episode's reward is `reward.kind`'s (the run returns None): math-verify on the last turn's answer.

`run` lets the model choose (`tool_choice: auto`); `run_tool_first` makes its first turn a call of the Python
tool (forced opening), so even an untrained model's episodes go through the tool (the smoke recipe uses it).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from areal_jax.agents.examples.tools import answer_calls, ask, function_tool
from areal_jax.rewards.sandbox import Sandbox, SandboxLimits

MAX_TURNS = 4
OUTPUT_CHARS = 2000
SYSTEM = "Solve the problem. You may run Python with the python tool. Put the final answer within \\boxed{}."
PYTHON = function_tool("python", "Run a Python program and return what it prints.", code="the program")


@functools.cache
def _sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(timeout_s=5.0, memory_mb=512))


async def python_tool(arguments: dict[str, Any]) -> str:
    code = arguments.get("code")
    if not isinstance(code, str):
        return "error: python needs a string 'code'"
    result = await asyncio.to_thread(_sandbox().run, code)
    if result.timed_out:
        return "error: the program ran past its time limit"
    if result.error:
        return f"error: {result.error}"
    out = result.stdout.decode(errors="replace")[-OUTPUT_CHARS:]
    err = result.stderr.decode(errors="replace")[-OUTPUT_CHARS:]
    return out if result.exit_code == 0 else f"exit code {result.exit_code}\n{out}{err}"


async def _episode(client: Any, task: Any, first_choice: Any) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    choice = first_choice
    for _ in range(MAX_TURNS):
        message = await ask(client, messages=messages, tools=[PYTHON], tool_choice=choice)
        if message is None or not message.tool_calls:
            return None
        messages.append(message.model_dump(exclude_none=True))
        messages.extend(await answer_calls(message, {"python": python_tool}))
        choice = "auto"
    return None


async def run(client: Any, task: Any) -> None:
    return await _episode(client, task, "auto")


async def run_tool_first(client: Any, task: Any) -> None:
    return await _episode(client, task, {"type": "function", "function": {"name": "python"}})
