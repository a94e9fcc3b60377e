"""The request bodies the proxy accepts, checked at the boundary: `/v1/chat/completions` and `/v1/completions`
bodies into what a turn needs (normalized messages, tools, the tool choice, n, the sampling of the turn)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from areal_jax.agents import messages as msgs
from areal_jax.agents.messages import RequestError
from areal_jax.inference.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    conversation: tuple[str, ...]
    tools: list[Any] | None
    tools_key: str
    tool_choice: str | None  # "auto", "none", "required" or "function" (None: no tools)
    forced_tool: str | None  # the tool a "function" choice names
    n: int
    sampling: SamplingParams
    stream: bool


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    n: int
    sampling: SamplingParams


def chat_request(body: Any, base: SamplingParams, fixed_temperature: bool, *, max_n: int) -> ChatRequest:
    """A chat body checked; `max_n`: the most samples one request may ask for (`agent.max_n`)."""
    body = _object(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"messages: expected a non-empty list, got {raw!r}")
    normalized = [msgs.normalize(m, i) for i, m in enumerate(raw)]
    tools = body.get("tools") or None
    key = msgs.tools_key(tools)
    choice, forced = _tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(
        messages=normalized,
        conversation=tuple(msgs.key(m) for m in normalized),
        tools=tools,
        tools_key=key,
        tool_choice=choice,
        forced_tool=forced,
        n=_n(body, max_n),
        sampling=turn_sampling(body, base, fixed_temperature),
        stream=bool(body.get("stream", False)),
    )


def completion_request(body: Any, base: SamplingParams, fixed_temperature: bool, *, max_n: int) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise RequestError(f"prompt: expected one non-empty string or one list of token ids, got {prompt!r}")
    if body.get("stream"):
        raise RequestError("stream: /v1/completions does not stream; use /v1/chat/completions")
    return CompletionRequest(prompt=prompt, n=_n(body, max_n), sampling=turn_sampling(body, base, fixed_temperature))


def turn_sampling(body: Mapping[str, Any], base: SamplingParams, fixed_temperature: bool) -> SamplingParams:
    """`base` (the workflow's sampling, stop ids included) with the request's temperature, top_p, max_tokens,
    stop strings and seed."""
    changes: dict[str, Any] = {}
    temperature = body.get("temperature")
    if temperature is not None:
        if not _number(temperature) or temperature < 0:
            raise RequestError(f"temperature: expected a number >= 0, got {temperature!r}")
        if fixed_temperature and float(temperature) != base.temperature:
            raise RequestError(
                f"temperature: got {temperature}, but rollout.workflow.sampling.temperature={base.temperature} is "
                "the one the trainer scores at (agent.fixed_temperature); omit it"
            )
        changes["temperature"] = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _number(top_p) or not 0 < top_p <= 1:
            raise RequestError(f"top_p: expected a number in (0, 1], got {top_p!r}")
        changes["top_p"] = float(top_p)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(f"max_tokens: expected an integer >= 1, got {max_tokens!r}")
        changes["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop: expected a string or a list of non-empty strings, got {body.get('stop')!r}")
        changes["stop_strings"] = tuple(dict.fromkeys((*base.stop_strings, *stop)))
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise RequestError(f"seed: expected an integer >= 0, got {seed!r}")
        changes["seed"] = seed
    return base.replace(**changes) if changes else base


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got {body!r}")
    return body


def _n(body: Mapping[str, Any], max_n: int) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise RequestError(f"n: expected an integer in [1, {max_n}] (rollout.workflow.agent.max_n), got {n!r}")
    return n


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _tool_choice(choice: Any, tools: list[Any] | None) -> tuple[str | None, str | None]:
    if not tools:
        return None, None
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    function = choice.get("function") if isinstance(choice, Mapping) else None
    names = {t["function"]["name"] for t in tools}
    if not isinstance(function, Mapping) or function.get("name") not in names:
        raise RequestError(
            f"tool_choice: expected 'auto', 'none', 'required' or {{type: function, function: {{name}}}} naming one "
            f"of {sorted(names)}, got {choice!r}"
        )
    return "function", function["name"]
