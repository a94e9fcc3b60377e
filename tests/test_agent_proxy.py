"""The OpenAI-compatible proxy with the real `openai` client on localhost: chat and text completions on a tiny
model, the recorded ids and log-probs against a direct generator call, turns continuing the recorded ids,
tool calls (forced, malformed), streaming, the session ways, 429 while admission is closed, and an episode
whose agent is killed."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import urllib.request
from pathlib import Path

import openai
import pytest
from flax import nnx

from areal_jax.agents.local_transport import LocalTransport, route_of
from areal_jax.agents.server import AgentProxy, Route
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.tokenizer import CharTokenizer, HFTokenizer
from areal_jax.rollout.agent_config import AgentConfig
from areal_jax.rollout.staleness import Admission
from tests.tiny_hf_run import make_bpe_tokenizer_dir

# Qwen2.5's chat template with tools (Hermes <tool_call> syntax), its long tool preamble cut to the tools' names
# (the tests' tiny byte-level tokenizer spends a token per byte); messages are rendered as Qwen2.5 renders them.
TOOL_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] + ' ' }}\n"
    "    {%- endif %}\n"
    "    {{- 'Tools:' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- ' ' + tool.function.name }}\n"
    "    {%- endfor %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
MAX_TOKENS = 6


def tool_tokenizer_dir(directory: Path) -> Path:
    """The tests' byte-level BPE tokenizer with Qwen2.5's tool-calling chat template."""
    make_bpe_tokenizer_dir(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2))
    return directory


def tiny_generator(tokenizer: HFTokenizer, max_length: int = 256) -> tuple[Generator, nnx.State]:
    """A generator on a tiny random model for `tokenizer`, and the model's weights (to swap in as new versions)."""
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=max_length,
    )
    model = Decoder(config, nnx.Rngs(0))
    engine = Engine(
        model, EngineConfig(max_slots=16, max_length=max_length, min_prefill_bucket=128, max_prefill_batch=4)
    )
    state = nnx.state(model)
    return Generator(engine, engine.load_params(state, 0), detokenize=tokenizer.decode), state


def base_sampling(tokenizer: HFTokenizer) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=MAX_TOKENS, stop_token_ids=tokenizer.stop_token_ids)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer.from_dir(tool_tokenizer_dir(tmp_path_factory.mktemp("agent-tokenizer")))


@pytest.fixture(scope="module")
def generator_and_weights(tokenizer):
    generator, state = tiny_generator(tokenizer)
    with generator:
        yield generator, state


@pytest.fixture(scope="module")
def generator(generator_and_weights):
    return generator_and_weights[0]


class Gate:
    """An admission the test opens and closes, counting episodes admitted and released."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.admitted = 0
        self.released = 0

    def try_admit(self) -> Admission | None:
        if self.open.is_set():
            self.admitted += 1
            return Admission(version=0)
        return None

    def release(self, admission: Admission) -> None:
        self.released += 1


@pytest.fixture(scope="module")
def gate():
    gate = Gate()
    gate.open.set()
    return gate


@pytest.fixture(scope="module")
def proxy(generator, tokenizer, gate):
    with AgentProxy(generator, tokenizer, AgentConfig(), base_sampling(tokenizer), admission=gate) as proxy:
        yield proxy


def run(coro):
    return asyncio.run(coro)


_CLIENTS: dict[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = {}


async def _episode(proxy: AgentProxy, agent) -> tuple[object, list]:
    """One episode of `agent(client)` through the proxy, as the agent workflow runs it: (its value, sequences)."""
    loop = asyncio.get_running_loop()
    if loop not in _CLIENTS:  # one client per loop: making one costs ~40 ms, a copy with another URL nothing
        _CLIENTS[loop] = openai.AsyncOpenAI(base_url="http://unused", api_key="x", max_retries=0)
    session_id = await proxy.open_episode()
    try:
        value = await agent(_CLIENTS[loop].with_options(base_url=proxy.session_url(session_id)))
    finally:
        sequences = await proxy.close_episode(session_id)
    return value, sequences


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of each run of model tokens."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _tool_turns(messages, n_turns=2, **extra):
    """An agent: each turn forces a calculator call and answers it with a tool error (the random model's
    arguments are not JSON); the replies as the client got them."""

    async def agent(client):
        history, replies = list(messages), []
        for turn in range(n_turns):
            forced = {"type": "function", "function": {"name": "calculator"}}
            response = await client.chat.completions.create(
                model="policy", messages=history, tools=[CALCULATOR], tool_choice=forced, seed=3 + turn, **extra
            )
            message = response.choices[0].message
            replies.append(message)
            history.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                try:
                    json.loads(call.function.arguments)
                    result = "ok"
                except json.JSONDecodeError:
                    result = "error: the arguments are not JSON"
                history.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return replies

    return agent


def test_tool_call_turns_continue_the_recorded_ids_and_equal_a_direct_generator_call(proxy, generator, tokenizer):
    messages = [{"role": "user", "content": "What is 7 * 6?"}]
    replies, sequences = run(_episode(proxy, _tool_turns(messages)))
    assert len(sequences) == 1  # turn 2 continued turn 1's sequence
    (seq,) = sequences
    assert seq.turns == 2 and seq.divergences == 0
    for reply in replies:
        (call,) = reply.tool_calls
        assert call.function.name == "calculator" and call.type == "function"
    runs = _runs(seq.model)
    assert len(runs) == 2
    first_prompt = tokenizer.apply_chat_template(messages, tools=[CALCULATOR])
    opening = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments": ')
    assert seq.ids[: runs[0][0]] == [*first_prompt, *opening] and seq.prompt_length == runs[0][0]
    sampling = proxy.sampling
    for turn, (start, end) in enumerate(runs):
        (direct,) = asyncio.run(generator.generate(seq.ids[:start], sampling.replace(seed=3 + turn)))
        assert seq.ids[start:end] == list(direct.output_ids)
        assert seq.logprobs[start:end] == list(direct.output_logprobs)
        assert seq.versions[start:end] == list(direct.output_versions) == [0] * (end - start)
    assert not any(seq.logprobs[: runs[0][0]]) and set(seq.versions[runs[0][1] : runs[1][0]]) == {-1}
    # the second prompt is the first turn's exact ids, then the template's turn end, tool reply, generation prompt
    between = tokenizer.decode(seq.ids[runs[0][1] : runs[1][0]])
    assert between.endswith(
        "<tool_response>\nerror: the arguments are not JSON\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
    )


def test_the_local_transport_answers_and_records_as_http(proxy, tokenizer):
    messages = [{"role": "user", "content": "What is 7 * 6?"}]

    async def local(agent):
        async def on_the_proxy_loop(base_url):
            http = openai.DefaultAsyncHttpxClient(transport=LocalTransport(proxy))
            client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, http_client=http)
            return await agent(client)

        return await proxy.run_episode("local", on_the_proxy_loop)

    over_http, http_sequences = run(_episode(proxy, _tool_turns(messages)))
    in_process, local_sequences = run(local(_tool_turns(messages)))
    assert [r.model_dump(exclude={"tool_calls"}) for r in in_process] == [
        r.model_dump(exclude={"tool_calls"}) for r in over_http
    ]
    assert [[c.function for c in r.tool_calls] for r in in_process] == [
        [c.function for c in r.tool_calls] for r in over_http
    ]
    (seq,), (http_seq,) = local_sequences, http_sequences
    assert (seq.ids, seq.logprobs, seq.versions, seq.model) == (
        http_seq.ids,
        http_seq.logprobs,
        http_seq.versions,
        http_seq.model,
    )
    assert seq.turns == 2

    async def refused(client):
        with pytest.raises(openai.BadRequestError) as too_long:  # an error answer comes back as over HTTP
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x " * 300}])
        assert too_long.value.code == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError):
            await client.post("/nowhere", cast_to=object, body={})
        return "refused"

    assert run(local(refused))[0] == "refused"
    assert route_of("POST", "/sessions/s-1/v1/chat/completions", None) == Route("chat", "s-1", None)
    assert route_of("POST", "/v1/completions", "h") == Route("completion", None, "h")
    assert route_of("GET", "/sessions/s-1/v1/models", None) == Route("models", "s-1", None)
    assert route_of("POST", "/sessions/s-1/end", None) == Route("end", "s-1", None)
    assert route_of("GET", "/v1/chat/completions", None) is None
    assert sys.getswitchinterval() <= proxy.config.switch_interval_s  # the proxy shortened the GIL's


def test_streaming_gives_the_same_reply_and_text_completions_continue_the_recorded_ids(proxy, tokenizer):
    async def agent(client):
        messages = [{"role": "user", "content": "Say hi."}]
        whole = await client.chat.completions.create(model="p", messages=messages, seed=5)
        stream = await client.chat.completions.create(model="p", messages=messages, seed=5, stream=True)
        pieces = [chunk async for chunk in stream]
        first = await client.completions.create(model="p", prompt="1 + 2 =", max_tokens=3, seed=1)
        second = await client.completions.create(
            model="p", prompt="1 + 2 =" + first.choices[0].text + " 4", max_tokens=2
        )
        return whole, pieces, first, second

    (whole, pieces, first, second), sequences = run(_episode(proxy, agent))
    assert second.choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in pieces if c.choices][-1] == whole.choices[0].finish_reason
    chats = [s for s in sequences if s.conversation]
    assert len(chats) == 2 and chats[0].ids == chats[1].ids  # the same seed, the same prompt: the same sample
    texts = [s for s in sequences if not s.conversation]
    if first.choices[0].finish_reason == "length":  # no stop token, which the returned text would not show
        (seq,) = texts
        runs = _runs(seq.model)
        assert seq.turns == 2 and len(runs) == 2
        assert seq.ids[: runs[0][1]] == [*tokenizer.encode("1 + 2 ="), *seq.ids[runs[0][0] : runs[0][1]]]
        assert seq.ids[runs[0][1] : runs[1][0]] == tokenizer.encode(" 4")
    else:
        assert len(texts) == 2


def _end(proxy: AgentProxy, session_id: str) -> dict:
    request = urllib.request.Request(f"{proxy.url}/sessions/{session_id}/end", data=b"{}", method="POST")
    with urllib.request.urlopen(request) as answer:
        return json.loads(answer.read())


def test_a_new_episode_gets_429_while_admission_is_closed_and_episodes_in_flight_go_on(proxy, gate):
    def client(**headers):
        return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0, default_headers=headers)

    messages = [{"role": "user", "content": "hi"}]
    in_flight = client(**{"X-Session-Id": "external-early"})
    in_flight.chat.completions.create(model="p", messages=messages)  # opened while admission is open
    gate.open.clear()
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            client(**{"X-Session-Id": "external-late"}).chat.completions.create(model="p", messages=messages)
        assert refused.value.response.status_code == 429
        assert refused.value.response.headers["Retry-After"] == str(proxy.config.retry_after_s)
        with pytest.raises(openai.RateLimitError):  # the `user` field names a session too
            client().chat.completions.create(model="p", messages=messages, user="external-by-user")
        in_flight.chat.completions.create(model="p", messages=messages)  # never refused
    finally:
        gate.open.set()
    client(**{"X-Session-Id": "external-late"}).chat.completions.create(model="p", messages=messages)
    released = gate.released
    ended = _end(proxy, "external-early")
    assert gate.released == released + 1
    sequences = ended["sequences"]  # two requests that both start from the first message: two sequences
    assert len(sequences) == 2 and all(
        len(s["token_ids"]) == len(s["logprobs"]) == len(s["loss_mask"]) for s in sequences
    )
    assert _end(proxy, "external-late")["session_id"] == "external-late"
    with pytest.raises(openai.APIStatusError) as gone:  # an ended episode does not start again
        client(**{"X-Session-Id": "external-early"}).chat.completions.create(model="p", messages=messages)
    assert gone.value.response.status_code == 410
    with pytest.raises(openai.BadRequestError, match="no session"):
        client().chat.completions.create(model="p", messages=messages)


def test_an_agent_killed_mid_episode_loses_only_its_episode(proxy, generator):
    async def slow(client):
        return await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "count"}], max_tokens=400, stop=["@@never@@"]
        )

    async def quick(client):
        return await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])

    async def main():
        killed = asyncio.ensure_future(_episode(proxy, slow))
        survivor = asyncio.ensure_future(_episode(proxy, quick))
        while generator.stats.emitted_tokens == emitted:  # the killed agent's request is generating
            await asyncio.sleep(0.01)
        killed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await killed
        return await survivor

    emitted = generator.stats.emitted_tokens
    (response, sequences) = run(main())
    assert response.choices[0].message.content is not None and len(sequences) == 1
    deadline = 100
    while generator.num_in_flight() and deadline:  # the killed request was aborted, not finished
        deadline -= 1
        run(asyncio.sleep(0.05))
    assert generator.num_in_flight() == 0
    assert quick.__name__ and run(_episode(proxy, quick))[1]  # the proxy goes on serving


def test_200_sessions_from_8_threads_are_each_answered_once_during_weight_updates(proxy, generator_and_weights):
    generator, weights = generator_and_weights
    sessions_per_thread, threads = 25, 8
    answers: list[tuple[str, int, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    answered = threading.Event()  # another 40 answers: time for the next weight update

    async def two_turns(client, tag):
        history = [{"role": "user", "content": f"task {tag}"}]
        for turn in range(2):
            response = await client.chat.completions.create(model="p", messages=history, max_tokens=3)
            history.append(response.choices[0].message.model_dump(exclude_none=True))
            history.append({"role": "user", "content": "again"})
            with lock:
                answers.append((tag, turn, len(response.choices)))
                if len(answers) % 40 == 0:
                    answered.set()
        return tag

    def worker(index: int) -> None:
        async def main():
            episodes = [
                _episode(proxy, lambda c, t=f"{index}-{k}": two_turns(c, t)) for k in range(sessions_per_thread)
            ]
            return await asyncio.gather(*episodes)

        try:
            results.extend(asyncio.run(main()))
        except BaseException as err:
            errors.append(err)

    results: list = []
    updates_before = generator.stats.updates
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    version = generator.version
    while any(w.is_alive() for w in workers):
        if answered.wait(timeout=0.5):
            answered.clear()
            version += 1
            generator.update_params(weights, version, interrupt=True).result()
    for w in workers:
        w.join()
    assert not errors, errors
    assert len(results) == threads * sessions_per_thread
    assert sorted(answers) == sorted(
        (f"{i}-{k}", t, 1) for i in range(threads) for k in range(sessions_per_thread) for t in (0, 1)
    )
    for _, sequences in results:
        (seq,) = sequences  # each turn recorded once, the second continuing the first
        assert seq.turns == 2
        model_versions = [v for v, m in zip(seq.versions, seq.model, strict=True) if m]
        assert model_versions == sorted(model_versions)
    assert generator.stats.updates > updates_before and generator.stats.interruptions > 0
    assert generator.num_in_flight() == 0


def test_text_the_tokenizer_cannot_encode_is_a_400_not_a_server_error(generator, gate):
    chars = CharTokenizer()  # a fixed alphabet: the request's text fails before anything is generated
    with AgentProxy(generator, chars, AgentConfig(), base_sampling(chars), admission=gate) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="cannot encode"):
            client.completions.create(model="p", prompt="1+1=\N{EURO SIGN}", max_tokens=2, user="s")
