"""Small models and reference computations shared by the engine and generator tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.inference.generator import Generator
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder, KVCache

TINY = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    initializer_range=0.3,
)


def tiny_model(seed: int = 0) -> Decoder:
    return Decoder(TINY, nnx.Rngs(seed))


def greedy_reference(model: Decoder, prompt: list[int], steps: int, width: int = 64) -> list[int]:
    """Argmax decoding by full forwards without any cache (one jitted forward over a fixed width: the
    tokens after the sequence are padding, segment 0, which causal attention never lets it see)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state: nnx.State, tokens_1xW: jax.Array, n: jax.Array) -> jax.Array:
        segments_1xW = (jnp.arange(width) < n).astype(jnp.int32)[None]
        logits = nnx.merge(graphdef, state).logits(tokens_1xW, segments_1xW, jnp.arange(width)[None])
        return jnp.argmax(logits[0, n - 1])

    seq = list(prompt)
    for _ in range(steps):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(seq)] = seq
        seq.append(int(next_token(state, tokens, len(seq))))
    return seq[len(prompt) :]


def scoring_logprobs(model: Decoder, prompt: list[int], output: list[int], temperature: float) -> np.ndarray:
    """The trainer-side log-prob of each output token given everything before it."""
    seq = list(prompt) + list(output)
    n = len(seq)
    logp, _ = model.token_logprobs(
        jnp.asarray([seq]),
        jnp.asarray([[*seq[1:], 0]]),
        jnp.ones((1, n), jnp.int32),
        jnp.arange(n)[None],
        temperature,
    )
    return np.asarray(logp[0, len(prompt) - 1 : n - 1])


def cached_keys(cache: KVCache) -> np.ndarray:
    """The keys a cache holds, by position: [Y, B, S, K, H] (the cache stores each layer's as segments
    [B, K, H, S_j])."""
    return np.stack([np.concatenate([np.asarray(k) for k in layer], axis=3).transpose(0, 3, 1, 2) for layer in cache.k])


@contextlib.contextmanager
def all_at_once(generator: Generator) -> Iterator[None]:
    """What the block submits, aborts or updates reaches `generator`'s loop together, in one take of its
    inbox: the loop cannot take the inbox meanwhile, so it ends the iteration it is in, if any, and waits
    before the next (a pipelined decode step may still be in flight, handled before what the block posts)."""
    with generator._inbox._cond:  # the inbox's lock: the loop takes commands only while holding it
        yield
