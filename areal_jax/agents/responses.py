"""OpenAI response bodies: chat completions (whole or as server-sent-event chunks), text completions,
errors, the model list."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

from areal_jax.inference.requests import GenerationResult

MODEL_NAME = "areal-policy"


def new_id(prefix: str, hex_digits: int = 32) -> str:
    """A random id (`prefix` + hex digits) drawn without a system call: `uuid4` reads os.urandom, which lets go
    of the GIL and then waits for the generator's thread to give it back."""
    return f"{prefix}{random.getrandbits(4 * hex_digits):0{hex_digits}x}"


def _finish(result: GenerationResult, reply: dict[str, Any] | None = None) -> str:
    if reply is not None and reply.get("tool_calls"):
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def _usage(prompt_tokens: int, results: Sequence[GenerationResult]) -> dict[str, int]:
    completion = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _message(reply: dict[str, Any]) -> dict[str, Any]:
    calls = reply.get("tool_calls")
    return {
        "role": "assistant",
        "content": reply["content"] or (None if calls else ""),
        **({"tool_calls": calls} if calls else {}),
    }


def chat_completion(
    prompt_tokens: int, results: Sequence[GenerationResult], replies: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [
            {"index": i, "message": _message(reply), "finish_reason": _finish(result, reply), "logprobs": None}
            for i, (result, reply) in enumerate(zip(results, replies, strict=True))
        ],
        "usage": _usage(prompt_tokens, results),
    }


def chat_chunks(
    prompt_tokens: int, results: Sequence[GenerationResult], replies: Sequence[dict[str, Any]]
) -> Iterator[bytes]:
    """The same answer as server-sent events: per choice a role-and-content chunk, its tool calls, its finish;
    then the usage and `[DONE]` (chunks come once the samples are finished)."""
    base = {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": MODEL_NAME,
    }

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n".encode()

    for i, (result, reply) in enumerate(zip(results, replies, strict=True)):
        message = _message(reply)
        yield event(
            [{"index": i, "delta": {"role": "assistant", "content": message["content"] or ""}, "finish_reason": None}]
        )
        if "tool_calls" in message:
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            yield event([{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}])
        yield event([{"index": i, "delta": {}, "finish_reason": _finish(result, reply)}])
    yield event([], usage=_usage(prompt_tokens, results))
    yield b"data: [DONE]\n\n"


def completion(prompt_tokens: int, results: Sequence[GenerationResult], texts: Sequence[str]) -> dict[str, Any]:
    return {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [
            {"index": i, "text": text, "finish_reason": _finish(result), "logprobs": None}
            for i, (result, text) in enumerate(zip(results, texts, strict=True))
        ],
        "usage": _usage(prompt_tokens, results),
    }


def error(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def models() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "areal-jax"}]}
