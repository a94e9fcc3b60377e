"""The Responses API (`/v1/responses`, the `openai` client) and Anthropic's Messages API (`/v1/messages`, the
`anthropic` client) on the proxy: the same episode (a system prompt, a forced tool call, its result, a second
turn) records the same token ids, log-probs and versions through either as through chat completions;
`previous_response_id` chains and is checked; malformed bodies get 400 naming the field while admission is
closed; streaming gives the same answer as a whole reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest

from areal_jax.agents import messages_api, responses_api
from areal_jax.agents.local_transport import LocalTransport, route_of
from areal_jax.agents.messages import RequestError
from areal_jax.agents.server import AgentProxy, Route
from areal_jax.models.tokenizer import HFTokenizer
from areal_jax.rollout.agent_config import AgentConfig
from tests.test_agent_proxy import CALCULATOR, MAX_TOKENS, Gate, base_sampling, tiny_generator, tool_tokenizer_dir

SYSTEM = "You are a calculator."
QUESTION = "What is 7 * 6?"
SEEDS = (3, 4)  # one per turn
SCHEMA = CALCULATOR["function"]["parameters"]
RESPONSES_TOOL = {"type": "function", "name": "calculator", "parameters": SCHEMA}
MESSAGES_TOOL = {"name": "calculator", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer.from_dir(tool_tokenizer_dir(tmp_path_factory.mktemp("api-tokenizer")))


@pytest.fixture(scope="module")
def gate():
    gate = Gate()
    gate.open.set()
    return gate


@pytest.fixture(scope="module")
def proxy(tokenizer, gate):
    generator, _ = tiny_generator(tokenizer)
    with generator, AgentProxy(generator, tokenizer, AgentConfig(), base_sampling(tokenizer), admission=gate) as proxy:
        yield proxy


def _tool_result(arguments: str) -> str:
    """What every agent's calculator answers: the random model's arguments are rarely a JSON object."""
    try:
        ok = isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        ok = False
    return "ok" if ok else "error: the arguments are not a JSON object"


def _openai(proxy: AgentProxy, session_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.session_url(session_id), api_key="x", max_retries=0)


def _anthropic(proxy: AgentProxy, session_id: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"{proxy.url}/sessions/{session_id}", api_key="x", max_retries=0)


def _episode(
    proxy: AgentProxy, client_for: Callable[[AgentProxy, str], Any], turns: Callable[..., Awaitable[Any]]
) -> tuple[Any, list]:
    """`turns(client)` as one episode the workflow opened, its client over HTTP: (its value, its sequences)."""

    async def main():
        session_id = await proxy.open_episode()
        try:
            async with client_for(proxy, session_id) as client:
                value = await turns(client)
        finally:
            sequences = await proxy.close_episode(session_id)
        return value, sequences

    return asyncio.run(main())


def _in_process(proxy: AgentProxy, turns: Callable[..., Awaitable[Any]]) -> tuple[Any, list]:
    """The same as a workflow's agent runs it: on the proxy's loop, its `openai` client in the process."""

    async def run(base_url):
        http = openai.DefaultAsyncHttpxClient(transport=LocalTransport(proxy))
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, http_client=http) as client:
            return await turns(client)

    return asyncio.run(proxy.run_episode("local", run))


async def _by_chat(client: openai.AsyncOpenAI) -> list[tuple[str, str]]:
    calls = []
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for seed in SEEDS:
        response = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=[CALCULATOR],
            tool_choice={"type": "function", "function": {"name": "calculator"}},
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls.append((call.function.name, call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_result(call.function.arguments)})
    return calls


def _by_responses(chained: bool) -> Callable[[openai.AsyncOpenAI], Awaitable[list[tuple[str, str]]]]:
    """The episode through the Responses API: chained by previous_response_id (each request only the new
    function_call_output items), or sending the whole input again with the output items as they came."""

    async def turns(client):
        calls: list[tuple[str, str]] = []
        items: Any = QUESTION if chained else [{"role": "user", "content": QUESTION}]
        previous = None
        for seed in SEEDS:
            response = await client.responses.create(
                model="policy",
                instructions=SYSTEM,
                input=items,
                tools=[RESPONSES_TOOL],
                tool_choice={"type": "function", "name": "calculator"},
                max_output_tokens=MAX_TOKENS,
                previous_response_id=previous,
                extra_body={"seed": seed},
            )
            outputs = [
                {"type": "function_call_output", "call_id": item.call_id, "output": _tool_result(item.arguments)}
                for item in response.output
                if item.type == "function_call"
            ]
            calls.extend((item.name, item.arguments) for item in response.output if item.type == "function_call")
            if chained:
                items, previous = outputs, response.id
            else:
                items = [*items, *(item.model_dump(exclude_none=True) for item in response.output), *outputs]
        return calls

    return turns


async def _by_messages(client: anthropic.AsyncAnthropic) -> list[tuple[str, str]]:
    calls = []
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    for seed in SEEDS:
        message = await client.messages.create(
            model="policy",
            system=SYSTEM,
            messages=messages,
            tools=[MESSAGES_TOOL],
            tool_choice={"type": "tool", "name": "calculator"},
            max_tokens=MAX_TOKENS,
            extra_body={"seed": seed},
        )
        assert message.stop_reason == "tool_use"
        messages.append(message.to_param())
        results = []
        for block in message.content:
            if block.type == "tool_use":
                raw = block.input.get(messages_api.RAW_ARGUMENTS)
                arguments = raw if raw is not None else json.dumps(block.input, ensure_ascii=False)
                calls.append((block.name, arguments))
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": _tool_result(arguments)})
        messages.append({"role": "user", "content": results})
    return calls


def test_one_episode_records_the_same_tokens_through_chat_responses_and_messages(proxy, tokenizer):
    episodes = {
        "chat": _episode(proxy, _openai, _by_chat),
        "responses chained": _episode(proxy, _openai, _by_responses(chained=True)),
        "responses whole input": _episode(proxy, _openai, _by_responses(chained=False)),
        "responses in process": _in_process(proxy, _by_responses(chained=True)),
        "messages": _episode(proxy, _anthropic, _by_messages),
    }
    records = {}
    for name, (calls, sequences) in episodes.items():
        assert len(sequences) == 1, name  # the second turn continued the first turn's recorded ids
        (seq,) = sequences
        assert seq.turns == 2 and seq.divergences == 0, name
        assert len(calls) == 2 and all(call_name == "calculator" for call_name, _ in calls), name
        records[name] = (calls, seq.ids, seq.logprobs, seq.versions, seq.model)
    assert all(record == records["chat"] for record in records.values()), {
        name: tokenizer.decode(record[1]) for name, record in records.items()
    }
    calls, ids, logprobs, _, model = records["chat"]
    assert sum(model) > 0 and any(logprobs)
    text = tokenizer.decode(ids)
    assert SYSTEM in text and QUESTION in text and _tool_result(calls[0][1]) in text


def test_previous_response_id_chains_within_an_episode_and_an_unknown_one_is_a_400(proxy):
    async def turns(client):
        first = await client.responses.create(model="p", input="Say hi.", max_output_tokens=3)
        assert first.output[0].type == "message" and first.output_text == first.output[0].content[0].text
        assert first.previous_response_id is None and first.usage.output_tokens >= 1
        second = await client.responses.create(
            model="p", input="Again.", previous_response_id=first.id, max_output_tokens=3, store=False
        )
        assert second.previous_response_id == first.id
        with pytest.raises(openai.BadRequestError) as unknown:
            await client.responses.create(model="p", input="x", previous_response_id="resp_nope")
        with pytest.raises(openai.BadRequestError) as unstored:  # store: false keeps nothing to chain on
            await client.responses.create(model="p", input="x", previous_response_id=second.id)
        return first.id, unknown.value, unstored.value

    (first_id, unknown, unstored), sequences = _episode(proxy, _openai, turns)
    (seq,) = sequences  # the chained turn continued the first turn's ids
    assert seq.turns == 2
    for error in (unknown, unstored):
        assert error.status_code == 400
        assert error.response.json()["error"]["message"].startswith("previous_response_id: no response")

    async def after_the_end(client):  # an ended episode's responses are dropped
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await client.responses.create(model="p", input="x", previous_response_id=first_id)

    _episode(proxy, _openai, after_the_end)


RESPONSES_MALFORMED = [
    ({}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice.name"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
]
MESSAGES_MALFORMED = [
    ({"max_tokens": 4}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
        "messages[0].content[0].type",
    ),
    (
        {
            "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
            "max_tokens": 4,
        },
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]},
        "messages[0].content[0].input",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "top_k": 5}, "top_k"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "system": [{"type": "image"}]}, "system[0]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}], "max_tokens": 4},
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stop_sequences": "x"}, "stop_sequences"),
    (
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tools": [{"type": "bash_20250124"}]},
        "tools[0].type",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "tools": [MESSAGES_TOOL],
            "tool_choice": {"type": "tool", "name": "f"},
        },
        "tool_choice.name",
    ),
]


def test_malformed_bodies_get_400_naming_the_field_while_admission_is_closed(proxy, gate):
    headers = {"X-Session-Id": "api-new-episode"}
    openai_client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0, default_headers=headers)
    anthropic_client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0, default_headers=headers)
    gate.open.clear()
    try:
        for body, field in RESPONSES_MALFORMED:
            with pytest.raises(openai.BadRequestError) as refused:
                openai_client.post("/responses", cast_to=object, body=body)
            assert refused.value.response.json()["error"]["message"].startswith(field), (body, refused.value)
        for body, field in MESSAGES_MALFORMED:
            with pytest.raises(anthropic.BadRequestError) as refused:
                anthropic_client.post("/v1/messages", cast_to=object, body=body)
            assert refused.value.response.json()["error"]["message"].startswith(field), (body, refused.value)
        for path in ("/v1/responses", "/v1/messages"):
            request = urllib.request.Request(proxy.url + path, data=b"{oops", method="POST", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as not_json:
                urllib.request.urlopen(request)
            assert not_json.value.code == 400
        with pytest.raises(openai.RateLimitError):  # a valid request that would open the episode: 429
            openai_client.responses.create(model="p", input="hi")
        with pytest.raises(anthropic.RateLimitError):
            anthropic_client.messages.create(model="p", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    finally:
        gate.open.set()


def test_streamed_answers_equal_whole_ones_and_record_the_same_tokens(proxy):
    @contextlib.asynccontextmanager
    async def both(proxy, session_id):
        async with _openai(proxy, session_id) as client, _anthropic(proxy, session_id) as claude:
            yield client, claude

    async def turns(clients):
        client, claude = clients
        ask = {"model": "p", "input": QUESTION, "tools": [RESPONSES_TOOL], "extra_body": {"seed": 7}}
        ask["tool_choice"] = {"type": "function", "name": "calculator"}
        whole = await client.responses.create(**ask)
        events = [event async for event in await client.responses.create(**ask, stream=True)]
        async with client.responses.stream(**ask) as stream:
            final = await stream.get_final_response()
        talk = {"model": "p", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": QUESTION}]}
        talk |= {"tools": [MESSAGES_TOOL], "tool_choice": {"type": "tool", "name": "calculator"}}
        message = await claude.messages.create(**talk, extra_body={"seed": 7})
        async with claude.messages.stream(**talk, extra_body={"seed": 7}) as message_stream:
            streamed = await message_stream.get_final_message()
        return whole, events, final, message, streamed

    (whole, events, final, message, streamed), sequences = _episode(proxy, both, turns)
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))

    def items(response):  # without the ids (new ones each turn) and the stream helper's parsed_arguments
        ignored = ("id", "call_id", "parsed_arguments")
        return [{k: v for k, v in item.model_dump().items() if k not in ignored} for item in response.output]

    assert items(events[-1].response) == items(final) == items(whole)
    assert any(item.type == "function_call" for item in whole.output)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(item.arguments for item in whole.output if item.type == "function_call")

    def blocks(message):
        return [{k: v for k, v in block.model_dump().items() if k != "id"} for block in message.content]

    assert blocks(streamed) == blocks(message) and message.stop_reason == streamed.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == message.usage.output_tokens >= 1
    assert len(sequences) == 5  # five turns from the same first message: five sequences
    assert len({tuple(s.ids) for s in sequences}) == 1  # the same prompt and seed: the same sample, whichever API
    assert len({tuple(s.logprobs) for s in sequences}) == 1


def test_the_translations_without_a_model():
    chat, stream = messages_api.parse(
        {
            "system": [{"type": "text", "text": "S"}],
            "max_tokens": 5,
            "metadata": {"user_id": "episode-7"},
            "messages": [
                {"role": "user", "content": "Q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me see."},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                        {"type": "tool_use", "id": "t2", "name": "f", "input": {messages_api.RAW_ARGUMENTS: "{oops"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
                        {"type": "tool_result", "tool_use_id": "t2", "content": "bad", "is_error": True},
                        {"type": "text", "text": "And now?"},
                    ],
                },
            ],
        }
    )
    assert not stream and chat["max_tokens"] == 5 and chat["user"] == "episode-7"
    assert chat["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "t2", "type": "function", "function": {"name": "f", "arguments": "{oops"}},
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "2"},
        {"role": "tool", "tool_call_id": "t2", "content": "bad"},
        {"role": "user", "content": "And now?"},
    ]
    store = responses_api.ResponseStore()
    store.put("resp_1", "episode-7", ({"role": "user", "content": "Q"},))
    request = responses_api.parse(
        {
            "previous_response_id": "resp_1",
            "instructions": "S",
            "input": [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hm."}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "3"},
                {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            ],
        },
        store,
    )
    assert request.chat["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Hm.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "system", "content": "Be brief."},
    ]
    assert request.conversation == request.chat["messages"][1:]  # the instructions are not carried on
    store.drop("episode-7")
    with pytest.raises(RequestError, match="previous_response_id"):
        responses_api.parse({"previous_response_id": "resp_1", "input": "x"}, store)
    assert route_of("POST", "/sessions/s-1/v1/responses", None) == Route("responses", "s-1", None)
    assert route_of("POST", "/v1/messages", "h") == Route("messages", None, "h")
