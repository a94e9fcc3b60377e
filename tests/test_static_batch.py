"""Static-batch generation: greedy decoding with the KV cache equals argmax over full forwards."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.inference.static_batch import StaticBatchGenerator, bucket_length
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from tests.engine_fixtures import greedy_reference

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, initializer_range=0.3)


def test_greedy_with_cache_equals_full_forward_argmax():
    model = Decoder(CFG, nnx.Rngs(0))
    generator = StaticBatchGenerator(model, stop_token_ids=[39])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    completions = generator.generate(prompts, max_new_tokens=6, temperature=0.0, key=jax.random.key(0))
    for prompt, completion in zip(prompts, completions, strict=True):
        expected = greedy_reference(model, prompt, 6)
        if 39 in expected:
            expected = expected[: expected.index(39) + 1]
        assert list(completion.output_ids) == expected
        assert completion.finish_reason == ("stop" if expected[-1] == 39 else "length")


def test_sampled_logprobs_match_tempered_scoring():
    model = Decoder(CFG, nnx.Rngs(1))
    generator = StaticBatchGenerator(model, stop_token_ids=[0])
    prompt = [5, 6, 7]
    (completion,) = generator.generate([prompt], max_new_tokens=5, temperature=0.7, key=jax.random.key(3))
    seq = prompt + list(completion.output_ids)
    n = len(seq)
    logp, _ = model.token_logprobs(
        jnp.asarray([seq]), jnp.asarray([[*seq[1:], 0]]), jnp.ones((1, n), jnp.int32), jnp.arange(n)[None], 0.7
    )
    scored = np.asarray(logp[0, len(prompt) - 1 : n - 1])
    np.testing.assert_allclose(scored, completion.logprobs, atol=1e-5)


def test_bucketing_bounds_compilations():
    assert [bucket_length(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    model = Decoder(CFG, nnx.Rngs(2))
    generator = StaticBatchGenerator(model, stop_token_ids=[0])
    rng = np.random.default_rng(0)
    for n in rng.integers(1, 16, 6):
        generator.generate([list(range(1, n + 1))], max_new_tokens=2, temperature=0.0, key=jax.random.key(0))
    assert generator._prefill._cache_size() == 1
    assert generator._decode._cache_size() == 1
