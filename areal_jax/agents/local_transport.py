"""The agent workflow's way to the proxy in the same process: an `openai` client whose HTTP transport hands each
request to the proxy's handler on the proxy's loop, with no socket, no HTTP encoding and no second thread in
between (`agent.transport: local`). The requests, answers and records are those of the HTTP routes."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import httpx2

from areal_jax.agents.server import SESSION_HEADER, Route

if TYPE_CHECKING:
    from areal_jax.agents.server import AgentProxy

_PATHS = (
    (re.compile(r"(?:/sessions/(?P<session>[^/]+))?/v1/chat/completions"), "POST", "chat"),
    (re.compile(r"(?:/sessions/(?P<session>[^/]+))?/v1/completions"), "POST", "completion"),
    (re.compile(r"(?:/sessions/(?P<session>[^/]+))?/v1/models"), "GET", "models"),
    (re.compile(r"(?:/sessions/(?P<session>[^/]+))?/v1/responses"), "POST", "responses"),
    (re.compile(r"(?:/sessions/(?P<session>[^/]+))?/v1/messages"), "POST", "messages"),
    (re.compile(r"/sessions/(?P<session>[^/]+)/end"), "POST", "end"),
)


def route_of(method: str, path: str, header_session: str | None) -> Route | None:
    """The route a request's method and path name (as the HTTP server routes them); None: no such route."""
    for pattern, wanted, kind in _PATHS:
        match = pattern.fullmatch(path)
        if match is not None and method == wanted:
            return Route(kind, match.group("session"), header_session)
    return None


class LocalTransport(httpx2.AsyncBaseTransport):
    """Answers an `httpx2.AsyncClient`'s requests with `proxy.answer`; used on the proxy's own loop."""

    def __init__(self, proxy: AgentProxy):
        self.proxy = proxy

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        route = route_of(request.method, request.url.path, request.headers.get(SESSION_HEADER))
        if route is None:
            return httpx2.Response(404, json={"error": {"message": f"no route {request.method} {request.url.path}"}})
        answer = await self.proxy.answer(route, await request.aread())
        return httpx2.Response(answer.status, headers=answer.headers, content=answer.body, request=request)
