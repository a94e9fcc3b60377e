"""`JetStreamEngine` driven by JetStream 0.2.2's own orchestrator (`Driver` + `LLMOrchestrator.Decode`) on a tiny
random model: greedy outputs equal our generator's and argmax decoding, with concurrent requests, max_tokens,
the cache end, sampling and stop ids, text requests through the tokenizer bridge and an HF tokenizer without BOS."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from areal_jax.inference.engine import Engine, EngineConfig, VersionedParams
from areal_jax.inference.generator import Generator
from areal_jax.inference.jetstream_adapter import NO_TOKEN, JetStreamEngine
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.decoder import Decoder
from areal_jax.models.tokenizer import CharTokenizer, HFTokenizer
from areal_jax.sharding import MeshConfig, make_mesh
from tests.engine_fixtures import TINY

logging.getLogger().setLevel(logging.WARNING)  # importing the orchestrator set the root logger to DEBUG

GREEDY = SamplingParams(temperature=0.0)
MAX_LENGTH = 64
# Six concurrent requests on four slots; the last prompt fills the cache after four tokens.
PROMPT_LENGTHS = (3, 1, 12, 20, 7, MAX_LENGTH - 5)
MAX_TOKENS = (6, 9, 4, 12, 1, 20)


@dataclasses.dataclass(frozen=True)
class Setup:
    model: Decoder
    engine: Engine
    params: VersionedParams

    def argmax_decoding(self, prompt: Sequence[int], steps: int) -> list[int]:
        """Argmax decoding by full forwards without a cache (one program: sequences padded to MAX_LENGTH)."""
        graphdef, state = nnx.split(self.model)
        tokens_T = np.zeros(MAX_LENGTH, np.int32)
        tokens_T[: len(prompt)] = prompt
        for n in range(len(prompt), len(prompt) + steps):
            tokens_T[n] = _next_argmax(graphdef, state, jnp.asarray(tokens_T), n)
        return tokens_T[len(prompt) : len(prompt) + steps].tolist()


@functools.partial(jax.jit, static_argnums=(0,))
def _next_argmax(graphdef: nnx.GraphDef, state: nnx.State, tokens_T: jax.Array, n: jax.Array) -> jax.Array:
    positions_T = jnp.arange(tokens_T.shape[0])
    segment_ids_T = (positions_T < n).astype(jnp.int32)
    logits_1xTxV = nnx.merge(graphdef, state).logits(tokens_T[None], segment_ids_T[None], positions_T[None])
    return jnp.argmax(logits_1xTxV[0, n - 1])


@pytest.fixture(scope="module")
def setup() -> Setup:
    model = Decoder(dataclasses.replace(TINY, vocab_size=CharTokenizer().vocab_size), nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=4, max_length=MAX_LENGTH, min_prefill_bucket=16))
    return Setup(model, engine, engine.load_params(nnx.state(model), 0))


def decode_through_jetstream(
    adapter: JetStreamEngine,
    params: VersionedParams,
    requests: Sequence[jetstream_pb2.DecodeRequest],
    interleaved: bool,
) -> list[tuple[list[int], str]]:
    """(token ids, text) of each request, all submitted at once to JetStream's orchestrator."""
    driver = orchestrator.Driver(
        prefill_engines=[adapter],
        generate_engines=[adapter],
        prefill_params=[params],
        generate_params=[params],
        interleaved_mode=interleaved,
    )
    client = orchestrator.LLMOrchestrator(driver=driver)

    async def one(request: jetstream_pb2.DecodeRequest) -> tuple[list[int], str]:
        ids: list[int] = []
        text = []
        async for response in client.Decode(request):
            for sample in response.stream_content.samples:
                ids.extend(sample.token_ids)
                text.append(sample.text)
        return ids, "".join(text)

    async def everything() -> list[tuple[list[int], str]]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(r) for r in requests)), timeout=90)
        finally:
            # Inside the loop: the detokenize thread may still post a request's close to it.
            driver.stop()

    return asyncio.run(everything())


def token_request(prompt: Sequence[int], max_tokens: int) -> jetstream_pb2.DecodeRequest:
    content = jetstream_pb2.DecodeRequest.TokenContent(token_ids=list(prompt))
    return jetstream_pb2.DecodeRequest(token_content=content, max_tokens=max_tokens)


def text_request(text: str, max_tokens: int) -> jetstream_pb2.DecodeRequest:
    content = jetstream_pb2.DecodeRequest.TextContent(text=text)
    return jetstream_pb2.DecodeRequest(text_content=content, max_tokens=max_tokens)


def generator_outputs(
    setup: Setup, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], stop_ids: Sequence[int] = (2,)
) -> list[list[int]]:
    """Our generator's greedy outputs, ending before the first stop token as JetStream returns them."""
    with Generator(setup.engine, setup.params) as gen:
        futures = [
            gen.submit(p, dataclasses.replace(GREEDY, max_new_tokens=k, stop_token_ids=stop_ids))
            for p, k in zip(prompts, max_tokens, strict=True)
        ]
        results = [f.result(timeout=60)[0] for f in futures]
    return [list(r.output_ids[:-1] if r.finish_reason == "stop" else r.output_ids) for r in results]


def until_stop(tokens: list[int], stop_ids: Sequence[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:i]
    return tokens


def random_prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, CharTokenizer().vocab_size, n).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("interleaved", [False, True], ids=["disaggregated", "interleaved"])
def test_greedy_through_jetstream_equals_generator_and_argmax(setup: Setup, interleaved: bool):
    tok = CharTokenizer()
    prompts = random_prompts()
    adapter = JetStreamEngine(setup.engine, tok, sampling=GREEDY)
    outputs = decode_through_jetstream(
        adapter, setup.params, [token_request(p, k) for p, k in zip(prompts, MAX_TOKENS, strict=True)], interleaved
    )
    with_bos = [[tok.bos_id, *p] for p in prompts]  # JetStream prepends the tokenizer's BOS
    expected = generator_outputs(setup, with_bos, MAX_TOKENS)
    for (ids, text), want, prompt, k in zip(outputs, expected, with_bos, MAX_TOKENS, strict=True):
        assert ids == want
        assert text == ""  # client-side tokenization: ids only
        # max_tokens, or as many as fit in the cache (none of these outputs meets the stop token)
        steps = min(k, MAX_LENGTH - len(prompt))
        assert ids == setup.argmax_decoding(prompt, steps)


def test_sharded_engine_through_jetstream_equals_single_device(setup: Setup):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    engine = Engine(setup.model, setup.engine.config, mesh=mesh)
    params = engine.load_params(nnx.state(setup.model), 0)
    tok = CharTokenizer()
    adapter = JetStreamEngine(engine, tok, sampling=GREEDY)
    assert len(adapter.init_decode_state().emitted.sharding.device_set) == 8
    destination = adapter.get_prefix_destination_sharding()
    assert destination.cache.k.spec == PartitionSpec(None, "tensor", None, None)  # KV heads as in the cache
    prompts = random_prompts()[:4]
    requests = [token_request(p, k) for p, k in zip(prompts, MAX_TOKENS, strict=False)]
    outputs = decode_through_jetstream(adapter, params, requests, interleaved=False)
    expected = generator_outputs(setup, [[tok.bos_id, *p] for p in prompts], MAX_TOKENS[:4])
    assert [ids for ids, _ in outputs] == expected


def test_sampling_params_and_stop_ids_reach_the_engine(setup: Setup):
    tok = CharTokenizer()
    prompts = random_prompts()
    requests = [token_request(p, k) for p, k in zip(prompts, MAX_TOKENS, strict=True)]
    with_bos = [[tok.bos_id, *p] for p in prompts]
    greedy = generator_outputs(setup, with_bos, MAX_TOKENS)
    stop = collections.Counter(t for ids in greedy for t in ids[1:]).most_common(1)[0][0]
    # Sampling at temperature 1 from the top-1 token is greedy; `stop` ends some outputs early.
    sampling = SamplingParams(temperature=1.0, top_k=1, stop_token_ids=(stop,))
    outputs = decode_through_jetstream(
        JetStreamEngine(setup.engine, tok, sampling=sampling), setup.params, requests, True
    )
    ids = [ids for ids, _ in outputs]
    assert ids == [until_stop(g, (stop,)) for g in greedy]
    assert ids == generator_outputs(setup, with_bos, MAX_TOKENS, stop_ids=(*tok.stop_token_ids, stop))
    assert ids != greedy


def test_text_requests_go_through_the_tokenizer_bridge(setup: Setup):
    tok = CharTokenizer()
    texts = ["12+34=", "Q: 7*8=\nA: "]
    adapter = JetStreamEngine(setup.engine, tok, sampling=GREEDY)
    outputs = decode_through_jetstream(adapter, setup.params, [text_request(t, 8) for t in texts], interleaved=True)
    expected = generator_outputs(setup, [tok.encode(t, add_special_tokens=True) for t in texts], [8, 8])
    for (ids, text), want in zip(outputs, expected, strict=True):
        assert ids == want
        assert text == tok.decode(ids)


def write_wordlevel_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A Qwen-like HF tokenizer directory (no BOS, eos <|im_end|>, pad <|endoftext|>) over words w0, w1, ..."""
    special = ["<|endoftext|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate([*special, *(f"w{i}" for i in range(vocab_size - len(special)))])}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def test_hf_tokenizer_without_bos(setup: Setup, tmp_path: Path):
    tok = HFTokenizer.from_dir(write_wordlevel_tokenizer(tmp_path / "tok", setup.model.config.vocab_size))
    assert tok.bos_id is None and tok.vocab_size == setup.model.config.vocab_size
    adapter = JetStreamEngine(setup.engine, tok, sampling=GREEDY)
    assert adapter.get_tokenizer().path == str(tmp_path / "tok")
    bridge = adapter.build_tokenizer(adapter.get_tokenizer())
    assert bridge.bos_id == NO_TOKEN and bridge.stop_tokens == set(tok.stop_token_ids)
    text = "w3 w1 w4 w1 w5"
    prompts = [[5, 6, 7, 8], [9], tok.encode(text)]
    requests = [token_request(prompts[0], 7), token_request(prompts[1], 7), text_request(text, 7), text_request("", 7)]
    outputs = decode_through_jetstream(adapter, setup.params, requests, interleaved=True)
    assert [ids for ids, _ in outputs[:3]] == generator_outputs(setup, prompts, [7, 7, 7], tok.stop_token_ids)
    assert outputs[3] == ([], "")  # an empty prompt (no BOS to condition on) ends without output
    ids, text_out = outputs[2]
    assert text_out == "".join(tok.decode([i]) for i in ids)


def test_prompts_without_room_end_without_output(setup: Setup):
    tok = CharTokenizer()
    adapter = JetStreamEngine(setup.engine, tok, sampling=GREEDY)
    too_long = random_prompts()[-1] * 2  # JetStream keeps its last MAX_LENGTH ids: the cache is full
    full = too_long[: MAX_LENGTH - 1]  # with the BOS, exactly MAX_LENGTH ids
    requests = [token_request(too_long, 5), token_request(full, 5), token_request([4, 5], 3)]
    outputs = decode_through_jetstream(adapter, setup.params, requests, interleaved=True)
    assert [ids for ids, _ in outputs[:2]] == [[], []]
    assert outputs[2][0] == generator_outputs(setup, [[tok.bos_id, 4, 5]], [3])[0]  # its neighbours are unaffected


def test_result_tokens_layout(setup: Setup):
    adapter = JetStreamEngine(setup.engine, CharTokenizer(), sampling=GREEDY)
    prompt = [1, 5, 6, 7]
    padded, n = setup.engine.pad_tokens(prompt)
    state = adapter.init_decode_state()
    prefix = adapter.prefill(params=setup.params, padded_tokens=padded, true_length=n)
    state = adapter.insert(prefix, state, 2)
    columns = []
    for _ in range(3):
        state, result = adapter.generate(setup.params, state)
        result = result.convert_to_numpy()
        assert result.data.shape == (4, 3) and result.data.dtype == np.int32
        columns.append(result.get_result_at_slot(2))
    assert [int(c.tokens[0, 0]) for c in columns] == setup.argmax_decoding(prompt, 3)
    assert [int(c.valid[0, 0]) for c in columns] == [1, 1, 1]
    assert [int(c.lengths[0]) for c in columns] == [1, 2, 3]


def test_refuses_what_jetstream_cannot_express(setup: Setup):
    with pytest.raises(ValueError, match="token ids only"):
        JetStreamEngine(setup.engine, CharTokenizer(), sampling=SamplingParams(stop_strings=("\n",)))
    odd = Engine(setup.model, EngineConfig(max_slots=2, max_length=48))
    with pytest.raises(ValueError, match="prefill lengths"):
        JetStreamEngine(odd, CharTokenizer(), sampling=GREEDY)
