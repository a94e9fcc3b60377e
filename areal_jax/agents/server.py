"""The OpenAI-compatible proxy: an aiohttp server on its own thread and event loop in front of the generator.

Routes (every `/v1/...` route also under `/sessions/{session_id}/v1/...`):
  POST /v1/chat/completions   messages, tools, tool_choice, n, temperature, top_p, max_tokens, stop, seed, stream
  POST /v1/completions        prompt (one string or one list of token ids), n, the same sampling fields
  GET  /v1/models
  POST /v1/responses          the OpenAI Responses API as a chat turn (`responses_api.py`)
  POST /v1/messages           Anthropic's Messages API as a chat turn (`messages_api.py`)
  POST /sessions/{session_id}/end   ends an episode a client opened (or was handed); body {"reward": r} optional;
                                    answers its recorded sequences
  GET  /v1/tasks/next          kind 'external': the next task's episode (`task_board.py`), else 429 with Retry-After
  POST /rl/set_reward          AReaL's form: {"reward": r, "interaction_id"?} for the episode the path
                               (/sessions/{session_id}/rl/...), X-Session-Id, body `session_id` or bearer token names
  POST /rl/end_session         AReaL's form of /sessions/{session_id}/end
A request is checked (400 naming the field, 413 over `agent.max_body_bytes`) before anything else, so a
malformed request is refused whether admission is open or not; only a valid one that would open an episode
can get 429.
A request belongs to the episode (session) named by its path, else its `X-Session-Id` header, else the body's
`user` field. The agent workflow opens its episodes itself (`open_episode`, admitted by the rollout controller);
a request naming an unknown session opens one if `admission` allows, else gets 429 with Retry-After; a
request of an episode in flight is never refused. Each turn awaits `Generator.generate` (continuous batching
with every other request; a weight update interrupts and re-prefills it, and the answer comes as usual);
its samples are recorded in the session (`sessions.py`, `turns.py`). A client that disconnects cancels its
request, which aborts its samples; ending an episode aborts its requests still generating.

The agent workflow runs each episode's agent on this server's loop (`run_episode`), its client answered by
`answer` in the process (`local_transport.py`) or over the port: one handler for both.

Ownership: the sessions live on this server's loop thread; other threads reach them through
`open_episode` / `close_episode` / `run_episode`, which run on that loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aiohttp import web

from areal_jax.agents import messages_api, responses, responses_api, turns
from areal_jax.agents.admission import EpisodeAdmission
from areal_jax.agents.messages import RequestError
from areal_jax.agents.prompts import ChatRenderer
from areal_jax.agents.requests import chat_request, completion_request
from areal_jax.agents.sessions import Session, TokenSequence
from areal_jax.agents.task_board import TaskBoard, reward_of, rl_session_id, task_json
from areal_jax.agents.tool_calls import resolve_format
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.tokenizer import TextNotEncodable, Tokenizer
from areal_jax.rollout.agent_config import AgentConfig

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
CONTEXT_FULL = "context_length_exceeded"  # the error code of a turn whose prompt does not fit the engine
_ENDED_KEPT = 100_000  # ended session ids remembered, so a late request gets 410 instead of a new episode
ACCEPT_BACKLOG = 2048  # connections waiting to be accepted (the kernel caps it at net.core.somaxconn)
T = TypeVar("T")


class HTTPRefusal(Exception):
    def __init__(
        self, status: int, message: str, kind: str, headers: dict[str, str] | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.kind, self.headers, self.code = status, kind, headers or {}, code


@dataclasses.dataclass(frozen=True)
class Route:
    """What a request asks for: `kind` (the route: 'chat', 'completion', 'responses', 'messages', 'models',
    'end', ...) and the session its path and its X-Session-Id header name."""

    kind: str
    session_id: str | None = None
    header_session_id: str | None = None
    authorization: str | None = None  # the Authorization header (AReaL's /rl/ routes name a session by it)


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]


class AgentProxy:
    """See the module docstring. `sampling`: the workflow's sampling (stop ids included) each turn starts from."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: Tokenizer,
        config: AgentConfig,
        sampling: SamplingParams,
        *,
        admission: EpisodeAdmission | None = None,
        port: int | None = None,
        tasks: TaskBoard | None = None,
    ):
        self.generator, self.tokenizer, self.config, self.sampling = generator, tokenizer, config, sampling
        self.admission = admission
        self.stored_responses = responses_api.ResponseStore()  # for the Responses API's previous_response_id
        self.tasks = tasks  # kind 'external': the tasks handed out to outside agents
        self.renderer = ChatRenderer(tokenizer)
        templates = getattr(tokenizer, "chat_templates", {})
        self.tool_format = resolve_format(config.tool_format, "".join(templates.values()))
        self.port = config.port if port is None else port
        self._sessions: dict[str, Session] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> AgentProxy:
        if self.config.switch_interval_s and sys.getswitchinterval() > self.config.switch_interval_s:
            sys.setswitchinterval(self.config.switch_interval_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="areal-agent-proxy", daemon=True)
        self._thread.start()
        self._on_loop(self._serve()).result()
        logger.info("agent proxy listening on %s (tool calls: %s)", self.url, self.tool_format)
        return self

    def close(self) -> None:
        if self._loop is None:
            return
        self._on_loop(self._shut_down()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None  # started with the loop
        self._thread.join()
        self._loop.close()
        self._loop = None

    def __enter__(self) -> AgentProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of one episode (`openai.AsyncOpenAI(base_url=...)`)."""
        return f"{self.url}/sessions/{session_id}/v1"

    # -- episodes, from any thread or loop -----------------------------------------------------------------

    async def open_episode(self, prefix: str = "episode") -> str:
        """A new episode's session id (admitted by the caller)."""
        return await asyncio.wrap_future(self._on_loop(self._open(responses.new_id(f"{prefix}-", 12))))

    async def close_episode(self, session_id: str) -> list[TokenSequence]:
        """End an episode: its requests still generating are aborted; its sequences no turn continued."""
        return await asyncio.wrap_future(self._on_loop(self._close(session_id)))

    async def run_episode(
        self, prefix: str, run: Callable[[str], Awaitable[T]], sampling: SamplingParams | None = None
    ) -> tuple[T, list[TokenSequence]]:
        """`run(base_url)` as one episode on this proxy's loop, a session open while it runs: its result and the
        episode's sequences (as `close_episode`). `sampling`: what its turns start from instead of the proxy's
        (the held-out evaluation's episodes). Cancelling the caller cancels `run`. An agent on the proxy's
        own loop makes each turn's round trip on one thread (no wake-up of another thread, which waits for the
        GIL, between a reply and the next request)."""
        return await asyncio.wrap_future(self._on_loop(self._run_episode(prefix, run, sampling)))

    async def post_group(
        self, group_id: int, task: Any, messages: list[dict[str, Any]], n: int
    ) -> concurrent.futures.Future[list[Any]]:
        """Post a group's `n` episodes to hand out (kind 'external'); its future gets their ends."""
        return await asyncio.wrap_future(self._on_loop(self._post_group(group_id, task, messages, n)))

    async def withdraw_group(self, group_id: int) -> None:
        """Take a group off the task board; its episodes still in flight are closed (their requests aborted)."""
        await asyncio.wrap_future(self._on_loop(self._withdraw_group(group_id)))

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._loop is None:
            raise RuntimeError("the agent proxy is not running; call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # -- on the loop -------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for prefix in ("", "/sessions/{session_id}"):
            app.router.add_post(f"{prefix}/v1/chat/completions", self._web("chat"))
            app.router.add_post(f"{prefix}/v1/completions", self._web("completion"))
            app.router.add_get(f"{prefix}/v1/models", self._web("models"))
            app.router.add_post(f"{prefix}/v1/responses", self._web("responses"))
            app.router.add_post(f"{prefix}/v1/messages", self._web("messages"))
        app.router.add_post("/sessions/{session_id}/end", self._web("end"))
        app.router.add_get("/v1/tasks/next", self._web("task"))
        for prefix in ("", "/sessions/{session_id}"):
            app.router.add_post(f"{prefix}/rl/set_reward", self._web("reward"))
            app.router.add_post(f"{prefix}/rl/end_session", self._web("end"))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        # a fleet of agents opens its connections at once: with aiohttp's backlog of 128 a busy loop overflows the
        # accept queue and clients' connects time out (the OpenAI client's connect timeout is 5 s)
        site = web.TCPSite(self._runner, self.config.host, self.port, backlog=ACCEPT_BACKLOG)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _shut_down(self) -> None:
        for session_id in list(self._sessions):
            await self._close(session_id)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _open(self, session_id: str, sampling: SamplingParams | None = None) -> str:
        self._sessions[session_id] = Session(session_id, external=False, sampling=sampling)
        return session_id

    async def _run_episode(
        self, prefix: str, run: Callable[[str], Awaitable[T]], sampling: SamplingParams | None
    ) -> tuple[T, list[TokenSequence]]:
        session_id = await self._open(responses.new_id(f"{prefix}-", 12), sampling)
        try:
            value = await run(self.session_url(session_id))
        finally:
            sequences = await self._close(session_id)
        return value, sequences

    async def _post_group(
        self, group_id: int, task: Any, messages: list[dict[str, Any]], n: int
    ) -> concurrent.futures.Future[list[Any]]:
        if self.tasks is None:
            raise RuntimeError("this proxy hands out no tasks (it was started without a task board)")
        return self.tasks.post(group_id, task, messages, n).done

    async def _withdraw_group(self, group_id: int) -> None:
        assert self.tasks is not None  # posted before
        for session_id in self.tasks.withdraw(group_id):
            if session_id in self._sessions:
                await self._close(session_id)

    async def _close(self, session_id: str) -> list[TokenSequence]:
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise KeyError(f"no episode {session_id!r} in flight")
        session.closed = True
        for request_id in session.in_flight:
            self.generator.abort(request_id)
        self._ended[session_id] = None
        self.stored_responses.drop(session_id)
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        if session.admission is not None and self.admission is not None:
            self.admission.release(session.admission)
        return session.leaves()

    @staticmethod
    def _session_id(route: Route, body: Any) -> str | None:
        session_id = route.session_id or route.header_session_id
        if session_id is None and isinstance(body, dict) and isinstance(body.get("user"), str):
            session_id = body["user"]
        return session_id or None

    def _base_sampling(self, route: Route, body: Any) -> SamplingParams:
        """What a request's turn starts from: its episode's sampling when it has its own, else the proxy's."""
        session = self._sessions.get(self._session_id(route, body) or "")
        return session.sampling if session is not None and session.sampling is not None else self.sampling

    def _session(self, route: Route, body: Any) -> Session:
        """The request's episode, opened when new if `admission` allows (call it after checking the request)."""
        session_id = self._session_id(route, body)
        if not session_id:
            raise HTTPRefusal(
                400,
                f"no session: use the base URL .../sessions/<id>/v1, the {SESSION_HEADER} header or the 'user' field",
                "invalid_request_error",
            )
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        if session_id in self._ended:
            raise HTTPRefusal(410, f"episode {session_id!r} has ended", "invalid_request_error")
        admission = None
        if self.admission is not None and (admission := self.admission.try_admit()) is None:
            raise HTTPRefusal(
                429,
                "admission is closed: rollouts are as far ahead of the trainer as the staleness bound allows; "
                "start the episode later",
                "rate_limit_exceeded",
                {"Retry-After": str(self.config.retry_after_s)},
            )
        session = self._sessions[session_id] = Session(session_id, external=True, admission=admission)
        return session

    def _web(self, kind: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            route = Route(
                kind,
                request.match_info.get("session_id"),
                request.headers.get(SESSION_HEADER),
                request.headers.get("Authorization"),
            )
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                answer = _refuse(self._too_large(request.content_length))
            else:
                answer = await self.answer(route, raw)
            return web.Response(status=answer.status, body=answer.body, headers=answer.headers)

        return handle

    async def answer(self, route: Route, raw: bytes) -> Answer:
        """The answer to one request (its body as sent); on this proxy's loop."""
        if len(raw) > self.config.max_body_bytes:
            return _refuse(self._too_large(len(raw)))
        try:
            body = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _refuse(HTTPRefusal(400, f"the body is not JSON: {err}", "invalid_request_error"))
        try:
            match route.kind:
                case "chat":
                    return await self._chat(route, body)
                case "responses":
                    return await self._responses(route, body)
                case "messages":
                    return await self._messages(route, body)
                case "completion":
                    return await self._completion(route, body)
                case "end":
                    return await self._end(route, body)
                case "task":
                    return await self._next_task()
                case "reward":
                    return await self._set_reward(route, body)
                case _:
                    return _json(responses.models())
        except RequestError as err:
            return _refuse(HTTPRefusal(400, str(err), "invalid_request_error"))
        except TextNotEncodable as err:  # the client's text, not the proxy, is at fault
            return _refuse(HTTPRefusal(400, f"the policy's tokenizer cannot encode it: {err}", "invalid_request_error"))
        except HTTPRefusal as err:
            return _refuse(err)

    async def _generate(self, session: Session, prompt_ids: list[int], sampling: SamplingParams, n: int) -> list:
        if not self.generator.engine.config.fits_prompt(len(prompt_ids)):
            raise HTTPRefusal(
                400,
                f"the prompt has {len(prompt_ids)} tokens; the engine takes fewer than "
                f"rollout.engine.max_length={self.generator.engine.config.max_length}",
                "invalid_request_error",
                code=CONTEXT_FULL,
            )
        request_id = f"{session.session_id}:r{next(self._ids)}"
        session.in_flight.add(request_id)
        try:
            results = await self.generator.generate(prompt_ids, sampling, n, request_id)
        finally:
            session.in_flight.discard(request_id)
        if session.closed:
            raise HTTPRefusal(
                410, f"episode {session.session_id!r} ended while this request generated", "invalid_request_error"
            )
        return results

    async def _chat(self, route: Route, body: Any) -> Answer:
        chat = chat_request(
            body, self._base_sampling(route, body), self.config.fixed_temperature, max_n=self.config.max_n
        )
        session = self._session(route, body)
        plan = turns.plan_chat(session, chat, self.renderer, self.config.template_rule, self.tool_format)
        prompt_ids = plan.prompt_ids()
        results = await self._generate(session, prompt_ids, chat.sampling, chat.n)
        replies = [turns.chat_reply(self.tokenizer, chat, plan, result, self.tool_format) for result in results]
        for result, reply in zip(results, replies, strict=True):
            turns.record_chat(session, chat, plan, result, reply)
        if not chat.stream:
            return _json(responses.chat_completion(len(prompt_ids), results, replies))
        chunks = b"".join(responses.chat_chunks(len(prompt_ids), results, replies))
        return Answer(200, chunks, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def _responses(self, route: Route, body: Any) -> Answer:
        """The Responses API as a chat turn (`responses_api.py`), checked before the episode is looked up."""
        request = responses_api.parse(body, self.stored_responses)
        session_id = self._session_id(route, request.chat)
        chat = functools.partial(self._chat_json, route)
        return _reply(await responses_api.respond(request, chat, self.stored_responses, session_id))

    async def _messages(self, route: Route, body: Any) -> Answer:
        """Anthropic's Messages API as a chat turn (`messages_api.py`), checked before the episode is looked up."""
        chat_body, stream = messages_api.parse(body)
        return _reply(await messages_api.respond(chat_body, stream, functools.partial(self._chat_json, route)))

    async def _chat_json(self, route: Route, body: dict[str, Any]) -> dict[str, Any]:
        """The chat route's chat.completion object for `body`."""
        return json.loads((await self._chat(route, body)).body)

    async def _completion(self, route: Route, body: Any) -> Answer:
        completion = completion_request(
            body, self._base_sampling(route, body), self.config.fixed_temperature, max_n=self.config.max_n
        )
        session = self._session(route, body)
        plan = turns.plan_completion(session, completion, self.tokenizer)
        prompt_ids = plan.prompt_ids()
        results = await self._generate(session, prompt_ids, completion.sampling, completion.n)
        for result in results:
            turns.record_completion(session, plan, result)
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]
        return _json(responses.completion(len(prompt_ids), results, texts))

    def _too_large(self, size: int | None) -> HTTPRefusal:
        return HTTPRefusal(
            413,
            f"body: {size if size is not None else 'more'} bytes is over rollout.workflow.agent.max_body_bytes="
            f"{self.config.max_body_bytes}",
            "invalid_request_error",
        )

    async def _end(self, route: Route, body: Any) -> Answer:
        """End an episode a client opened or was handed, with its reward when the body has one."""
        reward = reward_of(body, required=False)
        session_id = self._rl_session_id(route, body)
        session = None if session_id is None else self._sessions.get(session_id)
        claim = None if session_id is None or self.tasks is None else self.tasks.claim_of(session_id)
        if session_id is None or session is None or not (session.external or claim is not None):
            raise HTTPRefusal(
                404, f"no episode {session_id!r} opened by a client is in flight", "invalid_request_error"
            )
        sequences = await self._close(session_id)
        if claim is not None:
            assert self.tasks is not None  # a claim is the board's
            reward = self.tasks.end(claim, sequences, reward)
        return _json({"session_id": session_id, "reward": reward, "sequences": [_sequence_json(s) for s in sequences]})

    async def _set_reward(self, route: Route, body: Any) -> Answer:
        """AReaL's `/rl/set_reward`: the reward of a handed-out episode (the last one set counts), kept until
        it ends."""
        reward = reward_of(body, required=True)
        interaction = body.get("interaction_id")
        if interaction is not None and not isinstance(interaction, str):
            raise RequestError(f"interaction_id: expected a string or null, got {interaction!r}")
        session_id = self._rl_session_id(route, body)
        claim = None if session_id is None or self.tasks is None else self.tasks.claim_of(session_id)
        if claim is None:
            raise HTTPRefusal(404, f"no handed-out episode {session_id!r} is in flight", "invalid_request_error")
        claim.reward = reward
        return _json({"session_id": session_id, "reward": reward})

    async def _next_task(self) -> Answer:
        if self.tasks is None:
            raise HTTPRefusal(
                404, "this run hands out no tasks: rollout.workflow.kind is not 'external'", "invalid_request_error"
            )
        claim = self.tasks.claim()
        if claim is None:
            raise HTTPRefusal(
                429,
                "no task to hand out: rollouts are as far ahead of the trainer as the staleness bound allows, or "
                "every admitted task is handed out; ask again later",
                "rate_limit_exceeded",
                {"Retry-After": str(self.config.retry_after_s)},
            )
        self._sessions[claim.session_id] = Session(claim.session_id, external=False)
        return _json(task_json(claim, self.session_url(claim.session_id), self.config.episode_timeout_s))

    @staticmethod
    def _rl_session_id(route: Route, body: Any) -> str | None:
        return rl_session_id(body, route.header_session_id, route.authorization, route.session_id)


def _sequence_json(seq: TokenSequence) -> dict[str, Any]:
    return {
        "token_ids": seq.ids,
        "logprobs": seq.logprobs,
        "versions": seq.versions,
        "loss_mask": [int(m) for m in seq.model],
        "prompt_length": seq.prompt_length,
        "turns": seq.turns,
        "finish_reason": seq.finish_reason,
        "template_divergences": seq.divergences,
        "routing": None if (routing := seq.routing_array()) is None else routing.tolist(),
    }


def _reply(reply: dict[str, Any] | list[bytes]) -> Answer:
    """A translated route's answer: its JSON object, or its server-sent events."""
    if isinstance(reply, dict):
        return _json(reply)
    return Answer(200, b"".join(reply), {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})


def _refuse(refusal: HTTPRefusal) -> Answer:
    return _json(responses.error(str(refusal), refusal.kind, refusal.code), refusal.status, refusal.headers)
